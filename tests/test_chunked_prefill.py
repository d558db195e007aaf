"""Chunked prefill: prompts run in blocks of `prefill_chunk` tokens everywhere (the API, the CLI, the
server), and the server feeds a long prompt one chunk between decode steps, so a running stream keeps
getting tokens while it is admitted (PITFALLS 23). No timing is asserted: the test counts the
running stream's tokens delivered between the long prompt's arrival and its first token."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine import load
from engine.api import LLM
from engine.errors import InvalidArgumentError
from engine.sampling import SamplingParams
from engine.serve.scheduler import Failure, Job, Scheduler
from engine.steps import DEFAULT_PREFILL_CHUNK, MODULE_PREFILL_CHUNK, NATIVE_PREFILL_CHUNK, make_step

LONG = 400          # the long prompt: 25 chunks of 16


@pytest.fixture(scope="module")
def llm():
    return load("tiny", attention="softmax", prefill_chunk=16)   # given: used on the module path too


def ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 500, (n - 1,), generator=g).tolist()


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_chunked_prompt_block_equals_one_block(llm, path):
    """The stepper's chunks leave the logits one block would, within float error, on a padded batch."""
    m = llm.model
    a, b = ids(70, 1), ids(45, 2)
    tokens = torch.tensor([a, [0] * 25 + b])
    valid = torch.tensor([[True] * 70, [False] * 25 + [True] * 45])
    out = {}
    for chunk in (0, 16):
        step = make_step(m, prefill_chunk=chunk)
        state = m.init_state(2, 80, path)
        out[chunk] = step(tokens, state, valid=valid, last_only=True)[:, -1]
    d = (out[0] - out[16]).abs().max().item()
    print(f"max |logit diff| chunk 16 vs one block: {d:.2e}")
    assert d < 1e-4


def test_prefill_chunk_is_checked():
    with pytest.raises(InvalidArgumentError, match="prefill_chunk"):
        load("tiny", prefill_chunk=-1)
    with pytest.raises(InvalidArgumentError, match="prefill_chunk"):
        make_step(load("tiny").model, prefill_chunk=2.5)
    assert load("tiny").step.prefill_chunk == DEFAULT_PREFILL_CHUNK


def test_the_default_chunk_follows_the_path_that_prefills(monkeypatch):
    """Unless given, prompt blocks are NATIVE_PREFILL_CHUNK tokens where the C step prefills them and
    MODULE_PREFILL_CHUNK on the module path (a GPU, fp32 / bf16 weights, --backend torch): there each block
    re-read, and dequantized, every weight (SmolLM2 Q4_1, 600 tokens: 21.6 s in blocks of 16, 2.9 s in blocks
    of 512 on one core; a kernel launch an operation on a GPU). The logits are the one-block ones."""
    llm = load("tiny", attention="softmax")          # fp32 weights: PyTorch's GEMMs prefill them
    assert llm.step.chunk == MODULE_PREFILL_CHUNK and llm.step.prefill_chunk is None
    assert load("tiny", prefill_chunk=8).step.chunk == 8
    assert load("tiny", prefill_chunk=0).step.chunk == 0
    native = load("tiny", backend="native") if "native" in load("tiny").step.forms_available else None
    if native is not None:
        assert native.step.chunk == NATIVE_PREFILL_CHUNK
    m, blocks = llm.model, []
    real = m.step
    monkeypatch.setattr(m, "step", lambda tokens, state, **kw: blocks.append(tokens.shape[1]) or real(tokens, state, **kw))
    tokens = torch.tensor([ids(600, 3)])
    got = llm.step(tokens, m.init_state(1, 610, "softmax"), last_only=True)[:, -1]
    assert blocks == [512, 88]
    monkeypatch.setattr(m, "step", real)
    whole = make_step(m, prefill_chunk=0)(tokens, m.init_state(1, 610, "softmax"), last_only=True)[:, -1]
    assert (got - whole).abs().max().item() < 1e-4


class Collector:
    def __init__(self):
        self.ids, self.done, self.failed = [], threading.Event(), None

    def __call__(self, event):
        if isinstance(event, Failure):
            self.failed = event.message
            self.done.set()
            return
        self.ids.append(event.id)
        if event.finish_reason is not None:
            self.done.set()


def greedy():
    return SamplingParams(temperature=0.0)


def admitted_while_running(sched, path: str, n: int, max_tokens: int) -> tuple[int, list[int]]:
    """A stream runs on `path`; an n-token prompt (ids(n, 4)) arrives. Returns the stream's tokens
    between the prompt's arrival and its first token, and the prompt's tokens."""
    sched.start()
    try:
        running = Collector()
        sched.submit(Job(ids(8, 3), path, greedy(), max_tokens=10_000, emit=running, ignore_eos=True))
        while len(running.ids) < 3:
            running.done.wait(0.01)
        late, first_seen = Collector(), []

        def on_late(event):
            if not first_seen:
                first_seen.append(len(running.ids))
            late(event)
        at_submit = len(running.ids)
        sched.submit(Job(ids(n, 4), path, greedy(), max_tokens=max_tokens, emit=on_late))
        assert late.done.wait(60), late.failed
        assert late.failed is None
        return first_seen[0] - at_submit, late.ids
    finally:
        running_job_cancel(sched)
        sched.stop()


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_a_long_prompt_is_fed_between_decode_steps(llm, path):
    between, got = admitted_while_running(Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=4), path, LONG, 8)
    chunks = -(-LONG // llm.step.chunk)
    print(f"{between} tokens of the running stream while {chunks} chunks were fed")
    assert between >= chunks - 2      # one decode step per chunk (one iteration may have begun already)
    alone = LLM(llm.model, llm.tokenizer, attention=path).generate([ids(LONG, 4)], max_new_tokens=8, temperature=0,
                                                                 max_context=LONG + 8)[0]
    assert got == alone.ids           # the server's chunks are the API's: the same tokens


def running_job_cancel(sched):
    for pool in list(sched.pools.values()):
        for r in pool.rows:
            r.job.cancel()


def test_a_cancelled_prompt_leaves_while_being_fed(llm):
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=2, max_queue=0)
    sched.start()
    try:
        running = Collector()
        sched.submit(Job(ids(8, 5), "linear", greedy(), max_tokens=10_000, emit=running, ignore_eos=True))
        while len(running.ids) < 2:
            running.done.wait(0.01)
        long = Job(ids(4000, 6), "linear", greedy(), max_tokens=4, emit=Collector())
        sched.submit(long)
        while not sched.prefilling:
            running.done.wait(0.005)
        assert sched.stats()["prefilling"] == 1
        long.cancel()
        while sched.prefilling:
            running.done.wait(0.005)
        sched.submit(Job(ids(5, 7), "linear", greedy(), max_tokens=2, emit=Collector()))   # room again
    finally:
        running_job_cancel(sched)
        sched.stop()


@pytest.fixture(scope="module")
def native_llm():
    pytest.importorskip("engine.steps.native")
    llm = load("tiny", attention="softmax", backend="native")
    if "native" not in llm.step.forms_available:
        pytest.skip("no C compiler: the native step is not built")
    return llm


def drain(work):
    """Run a pieces generator to its end: (pieces it yielded, the value it returned)."""
    n = 0
    while True:
        try:
            next(work)
            n += 1
        except StopIteration as done:
            return n, done.value


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_a_prompt_fed_in_pieces_equals_it_fed_whole(native_llm, path):
    """Stepper.pieces: the native form runs a chunk a layer a piece (chunks x layers pieces), and the
    logits and the state it leaves are the whole block's, bit for bit."""
    m, step = native_llm.model, native_llm.step
    tokens = torch.tensor([ids(70, 8)])
    whole, pieces = m.init_state(1, 80, path), m.init_state(1, 80, path)
    want = step(tokens, whole, last_only=True)
    n, got = drain(step.pieces(tokens, pieces))
    assert step.last_prefill_form == "native"
    assert n == -(-70 // step.chunk) * m.config.num_hidden_layers
    assert torch.equal(got, want)
    assert pieces.slots == whole.slots == 70
    for a, b in zip(pieces.tensors(), whole.tensors()):
        assert torch.equal(a[..., :70, :] if path == "softmax" else a, b[..., :70, :] if path == "softmax" else b)


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_the_module_path_feeds_a_layer_a_piece_as_fed_whole(path):
    """On the module path (fp32 weights; a GPU) a block is 512 tokens, so Stepper.pieces runs it a layer a
    piece (Transformer.step_pieces): the server's stall per piece stays a layer of a block, and the logits
    and the state are the whole block's, bit for bit."""
    llm = load("tiny", attention=path)
    m, step = llm.model, llm.step
    tokens = torch.tensor([ids(600, 9)])
    whole, pieces = m.init_state(1, 610, path), m.init_state(1, 610, path)
    want = step(tokens, whole, last_only=True)
    n, got = drain(step.pieces(tokens, pieces))
    assert step.last_prefill_form == "module" and step.chunk == MODULE_PREFILL_CHUNK
    assert n == 2 * m.config.num_hidden_layers          # two blocks (512 + 88), a layer each a piece
    assert torch.equal(got, want)
    assert pieces.slots == whole.slots == 600
    for a, b in zip(pieces.tensors(), whole.tensors()):   # (a KV slot never written may hold anything)
        assert torch.equal(a[..., :600, :] if path == "softmax" else a, b[..., :600, :] if path == "softmax" else b)


def test_a_long_prompt_goes_a_layer_at_a_time_between_decode_steps(native_llm):
    """With no time to share (prefill_share 0) the server feeds one piece, a layer of a chunk, per
    iteration: the running stream gets a token per piece, and the long prompt's tokens are the API's."""
    llm, n = native_llm, 100
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=4, prefill_share=0.0)
    between, got = admitted_while_running(sched, "softmax", n, 6)
    pieces = -(-n // llm.step.chunk) * llm.model.config.num_hidden_layers
    print(f"{between} tokens of the running stream while {pieces} pieces were fed")
    assert between >= pieces - 2
    assert got == llm.generate([ids(n, 4)], max_new_tokens=6, temperature=0, max_context=n + 6)[0].ids


def test_a_prompt_state_in_the_prefix_cache_keeps_no_step_plan(native_llm):
    """A finished prompt's state is only read (the prefix cache keeps it): the native form drops its
    plan (scratch and thread buffers, ~4.5 MB each on SmolLM2; a server's 64 cached prompts held
    ~290 MB of them), and a later hit on it still gives the cold run's tokens."""
    from engine.serve.prefix_cache import PrefixCache

    llm = native_llm
    native = next(f for f in llm.step.forms if f.name == "native")
    cache = PrefixCache(max_entries=8)
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=4, cache=cache)
    sched.start()
    try:
        outs = []
        for seed in (1, 2, 1):
            got = Collector()
            sched.submit(Job(ids(40, seed), "softmax", greedy(), max_tokens=5, emit=got))
            assert got.done.wait(60) and got.failed is None
            outs.append(got.ids)
        assert cache.stats()["hits"] == 1 and outs[2] == outs[0]
        held = [e.state for e in cache.entries.values()]
        assert held and not any(state in native.plans for state in held)
    finally:
        sched.stop()


def test_the_loop_hands_the_heap_back_once_per_idle_spell(llm, monkeypatch):
    """Idle after work, the loop returns the C heap's free pages (models.pages.trim_heap) once; idle
    on, it does not again (a server that served a burst keeps ~135 MB of freed memory otherwise)."""
    import engine.serve.scheduler as scheduler

    calls = []
    monkeypatch.setattr(scheduler, "trim_heap", lambda: calls.append(time.monotonic()) or True)
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=2)
    sched.start()
    try:
        for seed in (1, 2):
            got = Collector()
            sched.submit(Job(ids(12, seed), "linear", greedy(), max_tokens=4, emit=got))
            assert got.done.wait(30) and got.failed is None
            deadline = time.monotonic() + 10
            while len(calls) < seed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(calls) == seed, "no trim once the work was done"
            time.sleep(1.2)                      # two more idle waits of the loop
            assert len(calls) == seed, "trimmed again while idle"
    finally:
        sched.stop()


def seen_on_the_loop(llm, probe, max_tokens: int) -> list:
    """probe() called on the scheduler's loop thread as each token of one request is emitted."""
    seen, got = [], Collector()
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=2)
    sched.start()
    try:
        sched.submit(Job(ids(12), "linear", greedy(), max_tokens=max_tokens,
                         emit=lambda event: seen.append(probe()) or got(event)))
        assert got.done.wait(30) and got.failed is None
    finally:
        sched.stop()
    return seen


def test_the_loop_runs_without_autograd(llm):
    """Autograd's mode is per thread and on by default: the loop turns it off, so nothing it runs (learned
    maps in a state's own decisions) hangs a graph of activations on a state it keeps."""
    assert seen_on_the_loop(llm, torch.is_grad_enabled, 3) == [False] * 3 and torch.is_grad_enabled()


def test_the_loop_defers_the_trims_of_freed_plans(llm, monkeypatch):
    """A trim (malloc_trim) costs 1-6 ms: the loop thread skips the ones made as each prompt plan is
    freed (once per admitted request) and trims once per idle spell instead; other threads still trim."""
    import threading

    import models.pages as pages
    calls = []
    monkeypatch.setattr(pages, "_malloc_trim", lambda pad: calls.append(threading.get_native_id()))
    # skipped on the loop thread (its idle trims still run: not when_freed)
    assert seen_on_the_loop(llm, lambda: pages.trim_heap(when_freed=True), 2) == [False, False]
    assert pages.trim_heap(when_freed=True) and calls[-1] == threading.get_native_id()   # this thread trims


def test_a_chunk_before_the_prompts_last_skips_the_output_layer(native_llm):
    """Stepper.pieces(..., logits=False) on the native form leaves the same state and returns no
    logits (the output layer, a 49k x 576 matrix on SmolLM2, runs for a prompt's last chunk only)."""
    m, step = native_llm.model, native_llm.step
    tokens = torch.tensor([ids(40, 9)])
    results = []
    for want_logits in (True, False):
        state = m.init_state(1, 48, "softmax")
        work = step.pieces(tokens, state, logits=want_logits)
        while True:
            try:
                next(work)
            except StopIteration as done:
                results.append((done.value, state))
                break
    (with_head, a), (without, b) = results
    assert with_head is not None and without is None
    assert torch.equal(a.k[..., :40, :], b.k[..., :40, :]) and a.slots == b.slots == 40
