"""gen linearize across processes (engine.distributed): two gloo ranks on the CPU (NCCL ranks where two
GPUs exist), each taking its slice of every global batch, give the maps and adapters one process gives
on the same global batches (within 1e-5); rank 0 alone writes and prints; a bad launch is one line, exit 2."""
import functools
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import engine.linearize as lin
from cli.main import main
from engine.attention.feature_maps import DECAY_INIT
from engine.distributed import Group
from engine.errors import InvalidArgumentError
from engine.linearize import LinearizeArgs
from models.linearized import write_adapters, write_maps
from tests.conftest import ROOT, sentence_corpus

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch build has no torch.distributed with gloo", allow_module_level=True)

RUN = dict(seq_len=32, tokens=1024, eval_rows=2, layer_steps=5, batch_size=4, finetune_steps=4,
           finetune_batch=4, save_every=2, seed=5, lora_rank=2, decay=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return sentence_corpus(tmp_path_factory.mktemp("data") / "text.txt", 300, seed=2)


def exact_outputs():
    """Maps and adapters written in fp32 (the file's default is fp16, whose rounding would hide or
    invent differences of 1e-5)."""
    lin.write_maps = functools.partial(write_maps, dtype=torch.float32)
    lin.write_adapters = functools.partial(write_adapters, dtype=torch.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPAWN_FAILED = importlib.import_module("torch.multiprocessing.spawn").ProcessException   # a rank raised or exited
# (the module, not torch.multiprocessing.spawn: that name is the function)


def spawn_ranks(world: int, kwargs: dict, tries: int = 3) -> None:
    """`world` ranks of one_rank on a free port; again on another port (the output removed) when a rank
    fails: the port picked may have been taken between free_port() freeing it and rank 0 binding it,
    which shows as a rank's error or as a rank that exited (the other rank's). A real failure fails every
    try and is raised."""
    for attempt in range(tries):
        try:
            torch.multiprocessing.spawn(one_rank, args=(world, free_port(), kwargs), nprocs=world)
            return
        except SPAWN_FAILED:
            if attempt == tries - 1:
                raise
            shutil.rmtree(kwargs["out"], ignore_errors=True)


def one_rank(rank: int, world: int, port: int, kwargs: dict) -> None:
    """A rank as torchrun starts it: its environment, then the same call as one process makes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    exact_outputs()
    lin.linearize(LinearizeArgs(**kwargs), log=lambda m: None)


def outputs(out) -> dict:
    return {**load_file(out / "maps.safetensors"), **load_file(out / "adapters.safetensors")}


@pytest.mark.parametrize("device, tol", [
    ("cpu", 1e-5),
    pytest.param("cuda", 1e-4, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                       reason="NCCL across ranks needs two CUDA devices")),
])
def test_two_ranks_equal_one_process_on_the_same_global_batch(device, tol, small_model_dir, corpus, tmp_path,
                                                              monkeypatch):
    """gloo on the CPU; NCCL, each rank on its own GPU, where there are two (GPU sums are not
    reproducible to the last bit: 1e-4 there)."""
    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setattr(lin, "write_maps", lin.write_maps)          # restored after exact_outputs()
    monkeypatch.setattr(lin, "write_adapters", lin.write_adapters)
    exact_outputs()
    base = dict(model=str(small_model_dir), data=[str(corpus)], device=device, **RUN)
    lin.linearize(LinearizeArgs(out=str(one), **base), log=lambda m: None)
    spawn_ranks(2, dict(out=str(two), **base))

    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())   # no work dir left
    a, b = outputs(one), outputs(two)
    assert set(a) == set(b) and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |one process - two ranks| over {len(a)} tensors: {worst:.2e}")
    assert worst <= tol
    # what is compared moved: the transfer left the identity maps, the finetune the zero adapters and the decay
    eye = torch.eye(a["feature_map.q.weight"].shape[-1])
    assert (a["feature_map.q.weight"] - eye).abs().max() > 1e-2 and a["adapter.o.b"].abs().max() > 1e-3
    assert (a["feature_map.decay"] - DECAY_INIT).abs().max() > 1e-3
    s1, s2 = (json.loads((d / "linearize.json").read_text()) for d in (one, two))
    assert (s1["processes"], s2["processes"]) == (1, 2)
    for (step1, loss1), (step2, loss2) in zip(s1["finetune_log"], s2["finetune_log"], strict=True):
        assert step1 == step2 and loss1 == pytest.approx(loss2, abs=1e-4)   # the whole batch's loss, logged
    l1, l2 = (json.loads((d / "transfer_losses.json").read_text())["layers"] for d in (one, two))
    for r1, r2 in zip(l1, l2, strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-4)


def test_torchrun_cli_rank_0_alone_prints_and_writes(small_model_dir, corpus, tmp_path):
    out = tmp_path / "lin"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    # --standalone: torchrun binds its rendezvous store on a port of its own choosing (localhost:0) and
    # hands it to the ranks; a port picked here and freed before torchrun binds it can be taken meanwhile
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "cli.main", "linearize", "-m", str(small_model_dir), "--data", str(corpus),
           "--out", str(out), "--seq-len", "32", "--tokens", "512", "--layer-steps", "2", "--batch-size", "2",
           "--finetune-steps", "2", "--finetune-batch", "2", "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr (every rank's)\n{r.stderr}"
    assert r.stdout.count("wrote ") == 1, r.stdout
    assert r.stderr.count("layer 0:") == 1, r.stderr   # the per-layer log: rank 0's only
    assert (out / "config.json").is_file() and not (out / ".linearize").exists()
    assert json.loads((out / "linearize.json").read_text())["processes"] == 2


def test_a_global_batch_must_split_evenly_over_the_ranks():
    group = Group(rank=1, world=4)
    with pytest.raises(InvalidArgumentError, match="--batch-size 6 does not split evenly over 4 processes"):
        group.check_batch("--batch-size", 6)
    rows = torch.arange(8)[:, None]
    assert group.shard(rows).flatten().tolist() == [2, 3]   # rank 1's slice of the global batch


def test_world_size_without_torchrun_is_one_line(small_model_dir, corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    r = CliRunner().invoke(main, ["linearize", "-m", str(small_model_dir), "--data", str(corpus),
                                  "--out", str(tmp_path / "x")])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == ["gen: error: WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT, RANK unset: "
                                             "launch with torchrun --nproc_per_node N (or unset WORLD_SIZE for "
                                             "one process)"]
    assert not (tmp_path / "x").exists()
