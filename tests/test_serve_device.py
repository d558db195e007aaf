"""`gen serve --device`: the continuous batching runs on the model's device. The scheduler makes every
tensor it feeds the step there (checked with a model that reports the 'meta' device), a sampled row
draws the same uniforms whatever the device, `gen serve --device cpu` answers as the API does, a bad
device is one line (exit 2) on every command that takes one, and on CUDA (skipped without it) the
server's greedy answers equal the CPU's."""
from __future__ import annotations


import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from engine.api import load
from engine.sampling import RowSampler, SamplingParams
from engine.serve.prefix_cache import PrefixCache
from engine.serve.scheduler import Job, Scheduler
from tests.test_chunked_prefill import Collector

httpx = pytest.importorskip("httpx")
from test_serve_shutdown import Served           # noqa: E402


class Reported:
    """The model, reporting another `device` (the scheduler must ask for that one)."""

    def __init__(self, model, device):
        self.__dict__.update(_model=model, device=torch.device(device))

    def __getattr__(self, name):
        return getattr(self._model, name)


class Recording:
    """`torch` as the scheduler's module sees it, recording the device every torch.tensor call asks
    for (and making the tensor on the CPU, where the model really is)."""

    def __init__(self):
        self.devices = []

    def tensor(self, data, *args, device=None, **kw):
        self.devices.append(device)
        return torch.tensor(data, *args, **kw)

    def __getattr__(self, name):
        return getattr(torch, name)


def run_jobs(model, step) -> list[list[int]]:
    """Two softmax prompts of one length (prefilled together), a long linear one (fed in chunks), a
    sampled linear one. Returns each job's ids and the scheduler's stats."""
    sched = Scheduler(model, None, step, max_batch=8, cache=PrefixCache(max_entries=0))
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)
    jobs = [([1, 5, 9, 20, 3], "softmax", greedy), ([1, 7, 7, 2, 30], "softmax", greedy),
            ([1] + list(range(10, 40)), "linear", greedy), ([1, 5, 9], "linear", sampled)]
    outs = [Collector() for _ in jobs]
    for (ids, path, params), out in zip(jobs, outs):
        sched.submit(Job(ids, path, params, max_tokens=6, emit=out, ignore_eos=True))
    sched.start()
    try:
        for out in outs:
            assert out.done.wait(30) and out.failed is None, out.failed
    finally:
        sched.stop()
    return [out.ids for out in outs], sched.stats()


def test_the_scheduler_makes_its_tensors_on_the_models_device(small_model_dir, monkeypatch):
    import engine.serve.scheduler as scheduler
    llm = load(str(small_model_dir), prefill_chunk=8)
    expected, stats = run_jobs(llm.model, llm.step)
    assert stats["device"] == "cpu"
    recording = Recording()
    monkeypatch.setattr(scheduler, "torch", recording)
    got, stats = run_jobs(Reported(llm.model, "meta"), llm.step)
    print(f"{len(recording.devices)} tensors made, on {set(recording.devices)}")
    # prefilled together, in chunks, alone; decode steps on both paths: every one asked for the model's device
    assert len(recording.devices) > 8 and set(recording.devices) == {torch.device("meta")}
    assert stats["device"] == "meta"
    assert got == expected


def test_a_sampled_row_draws_the_same_uniforms_on_every_device():
    """Its generator is a CPU one (a CUDA generator cannot fill the CPU block it is read from)."""
    params = SamplingParams(temperature=0.8, seed=7)
    draws = {}
    for device in ("cpu", "meta"):
        row = RowSampler(params, [], 50, device)
        draws[device] = [row.uniform() for _ in range(3)]
    assert draws["cpu"] == draws["meta"]


def test_gen_serve_device_cpu_answers_as_the_api(small_model_dir):
    served = Served(small_model_dir, "--device", "cpu")
    try:
        body = {"model": str(small_model_dir), "prompt": "the cat", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        stats = httpx.get(served.url + "/stats", timeout=10).json()
        assert stats["device"] == "cpu" and stats["steps"] > 0
    finally:
        served.kill()
    alone = load(str(small_model_dir)).generate(["the cat"], max_new_tokens=8, temperature=0, ignore_eos=True)[0]
    assert r.json()["choices"][0]["text"] == alone.text


COMMANDS = {"gen": ["--model", "{model}", "hi"], "chat": ["chat", "--model", "{model}"],
            "eval": ["eval", "--model", "{model}"], "bench": ["bench", "--model", "{model}"],
            "serve": ["serve", "--model", "{model}"],
            "train": ["train", "--train", "{data}", "--out", "{out}"],
            "linearize": ["linearize", "-m", "{model}", "--data", "{data}", "--out", "{out}"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("device, what", [("tpu", "unknown device 'tpu'"), ("cuda", "no CUDA"),
                                          ("cuda:7", "cuda:7")])
def test_a_bad_device_is_one_line_on_every_command(command, device, what, small_model_dir, tmp_path):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the CUDA devices asked for")
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    data = tmp_path / "data.txt"
    data.write_text("a b c\n")
    args = [a.format(model=small_model_dir, data=data, out=tmp_path / "out") for a in COMMANDS[command]]
    r = CliRunner().invoke(main, args[:-1] + ["--device", device, args[-1]] if command == "gen"
                           else args + ["--device", device])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: error: ") and what in lines[0], r.output
    assert not (tmp_path / "out").exists()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU script)")


@cuda
def test_serve_on_cuda_answers_as_on_the_cpu(small_model_dir):
    """The same greedy requests, batched, on cuda and on the CPU: the same tokens; a sampled one runs."""
    answers = {}
    for device in ("cpu", "cuda"):
        llm = load(str(small_model_dir), device=device, prefill_chunk=8)
        ids, stats = run_jobs(llm.model, llm.step)
        answers[device] = ids[:3]
        assert stats["device"].startswith(device) and len(ids[3]) == 6
    assert answers["cuda"] == answers["cpu"]
