"""`gen linearize --device` and `gen train --device`: training runs where the model is. On the CPU the
option is taken and recorded; on CUDA (skipped without it: run by the GPU script) the maps and losses
come out as the CPU's, within float error, and bf16 autocast runs there too."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import main
from engine.linearize import LinearizeArgs, linearize
from engine.loader import build as lin_build
from engine.train import TrainArgs, train
from tests.conftest import generated_sentences, sentence_corpus

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU script)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return sentence_corpus(tmp_path_factory.mktemp("data") / "text.txt", 200, seed=4)


def lin_args(model_dir, corpus, out, **kw):
    return LinearizeArgs(**{**dict(model=str(model_dir), data=[str(corpus)], out=str(out), seq_len=32, tokens=512,
                                   eval_rows=2, layer_steps=4, batch_size=2, finetune_steps=3, finetune_batch=2,
                                   seed=1, lora_rank=2), **kw})


def test_linearize_device_cpu_with_bf16_autocast(small_model_dir, corpus, tmp_path):
    out = tmp_path / "lin"
    r = CliRunner().invoke(main, ["linearize", "-m", str(small_model_dir), "--data", str(corpus), "--out", str(out),
                                  "--seq-len", "32", "--tokens", "512", "--layer-steps", "2", "--batch-size", "2",
                                  "--finetune-steps", "2", "--finetune-batch", "2", "--finetune-dtype", "bfloat16",
                                  "--device", "cpu"])
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "linearize.json").read_text())
    assert (summary["device"], summary["processes"], summary["finetune_dtype"]) == ("cpu", 1, "bfloat16")
    assert all(loss == loss for _, loss in summary["finetune_log"])   # finite, not NaN


def test_linearize_with_bf16_weights_tracks_fp32(small_model_dir, corpus, tmp_path, monkeypatch):
    """--dtype bfloat16: the frozen model is built in bf16 (half the memory), the maps stay fp32, and
    the transfer and finetune losses stay within bf16 rounding of the fp32 run's."""
    import engine.linearize as lin
    built = []
    monkeypatch.setattr(lin, "build", lambda *a, **kw: built.append(a[3]) or lin_build(*a, **kw))
    runs = {}
    for dtype in ("float32", "bfloat16"):
        runs[dtype] = linearize(lin_args(small_model_dir, corpus, tmp_path / dtype, dtype=dtype), log=lambda m: None)
    assert built == [torch.float32, torch.bfloat16]
    for (_, a), (_, b) in zip(runs["float32"]["finetune_log"], runs["bfloat16"]["finetune_log"], strict=True):
        assert a == pytest.approx(b, abs=1e-2)
    losses = {d: json.loads((tmp_path / d / "transfer_losses.json").read_text())["layers"] for d in runs}
    for a, b in zip(losses["float32"], losses["bfloat16"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=5e-2)
    maps = load_file(tmp_path / "bfloat16" / "maps.safetensors")
    assert all(torch.isfinite(t.float()).all() for t in maps.values())


# the plain run, and the window form with a learned gated decay (`decayed_parts`, what smollm2-linear-8k
# trains on a GPU loan): maps, adapters (and decay logits and gate) on CUDA come out as the CPU's
GATED = dict(hybrid=1, window=8, gate=True, decay_lr=0.2, gate_lr=0.05)


@cuda
@pytest.mark.parametrize("extra", [{}, GATED], ids=["plain", "window_gate"])
def test_linearize_on_cuda_equals_the_cpu(small_model_dir, corpus, tmp_path, extra):
    outs = {}
    for device in ("cpu", "cuda"):
        outs[device] = tmp_path / device
        linearize(lin_args(small_model_dir, corpus, outs[device], device=device, **extra), log=lambda m: None)
    if extra:
        maps = load_file(outs["cpu"] / "maps.safetensors")
        assert any("gate" in k for k in maps) and any("decay" in k for k in maps)
    for name in ("maps.safetensors", "adapters.safetensors"):   # fp16 files: within a few fp16 steps
        a, b = load_file(outs["cpu"] / name), load_file(outs["cuda"] / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k].float(), b[k].float(), atol=2e-3, rtol=1e-2), (name, k)
    summary = json.loads((outs["cuda"] / "linearize.json").read_text())
    assert summary["device"].startswith("cuda")


@cuda
def test_linearize_bf16_weights_and_autocast_on_cuda(small_model_dir, corpus, tmp_path):
    out = tmp_path / "bf16"
    summary = linearize(lin_args(small_model_dir, corpus, out, device="cuda", dtype="bfloat16",
                                 finetune_dtype="bfloat16"), log=lambda m: None)
    assert summary["finetune_steps_done"] == 3
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in summary["finetune_log"])


@cuda
def test_train_on_cuda_equals_the_cpu(tmp_path):
    data = tmp_path / "train.txt"
    data.write_text("\n<|endoftext|>\n".join(" ".join(generated_sentences(6, seed=i)) for i in range(60)))
    losses = {}
    for device in ("cpu", "cuda"):
        a = TrainArgs(train=str(data), valid=None, out=str(tmp_path / device), vocab_size=300, dim=32, layers=1,
                      heads=2, seq_len=32, batch_size=4, steps=3, warmup=1, save_every=10, progress=False, amp=None,
                      device=device, tokenizer=str(tmp_path / "cpu" / "tokenizer.model") if device == "cuda" else None)
        model = train(a, log=lambda *_: None)
        assert model.device.type == device
        losses[device] = torch.load(tmp_path / device / "checkpoint.pt", weights_only=False)["history"]
    for c, g in zip(losses["cpu"], losses["cuda"], strict=True):
        for path in ("softmax", "linear"):
            assert c[path] == pytest.approx(g[path], abs=2e-3)
