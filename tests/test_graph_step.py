"""The graph step form (engine.steps.graph_step): the static one-token step run eagerly equals the torch
step and the module path on every state kind (CPU); captured and replayed as a CUDA graph it equals
itself run eagerly (CUDA only: those tests skip without a GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from cli.main import main
from engine.attention import KVState
from engine.steps import BACKENDS, Stepper, check_backend
from engine.steps.decode_attention import softmax_decode
from engine.steps.graph_step import BUCKET_MIN, GraphStep, decode_bucket, static_shape, step_static
from engine.steps.torch_step import TorchStep
from tests.conftest import poison_unwritten, tiny_model
from tests.test_decay import decay_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graph capture and replay")

# name -> (model overrides, attention path); the hedgehog cases carry a learned (gated) decay
CASES = {
    "softmax": (dict(num_key_value_heads=2), "softmax"),
    "linear-elu1": (dict(num_key_value_heads=2), "linear"),
    "linear-hedgehog-decay": (dict(decay=True), "linear"),
    "linear-hedgehog-gated": (dict(decay=True, gated=True), "linear"),
    "window": (dict(num_key_value_heads=2, window=4), "linear"),
    "window-hedgehog-gated": (dict(decay=True, gated=True, window=4), "linear"),
    "window-hedgehog-decay": (dict(decay=True, window=4), "linear"),
    "hybrid": (dict(num_hidden_layers=3, num_key_value_heads=2, attention="hybrid",
                    layer_attention=("linear", "softmax", "linear")), "hybrid"),
    "hybrid-window": (dict(num_hidden_layers=3, num_key_value_heads=2, attention="hybrid", window=3,
                           layer_attention=("softmax", "linear", "linear")), "hybrid"),
    "qwen3-softmax": (dict(model_type="qwen3", num_key_value_heads=2), "softmax"),
    "qwen2-linear": (dict(model_type="qwen2", num_key_value_heads=1), "linear"),
}
PROMPT, STEPS = 5, 24      # with min_bucket 4 the softmax steps cross the buckets 8, 16 and 32


def make_model(case: str, dtype=torch.float32, device="cpu"):
    cfg, path = CASES[case]
    cfg = dict(cfg)
    if cfg.pop("decay", False):
        model = decay_model(gated=cfg.pop("gated", False), num_key_value_heads=2, **cfg)
    else:
        model = tiny_model(**cfg)
    return model.to(device=device, dtype=dtype), path


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def prefilled(model, path, tokens, valid=None, max_len=64):
    """A state holding tokens[:, :PROMPT] (left pads where valid is False), prefilled by the module path."""
    state = model.init_state(tokens.shape[0], max_len, attention=path)
    model.step(tokens[:, :PROMPT], state, valid=valid, last_only=True)
    return state


def joined(model, path, tokens, max_len=64):
    """A server's batch: rows prefilled alone with prompts of different lengths, joined (right-aligned KV rows,
    leading pad slots): a padded state."""
    rows = []
    for b in range(tokens.shape[0]):
        s = model.init_state(1, max_len, attention=path)
        model.step(tokens[b:b + 1, b:PROMPT], s, last_only=True)
        rows.append(s)
    return type(rows[0]).concat(rows, max_len)


def assert_same_state(a, b, tol):
    """What the states hold (their saved tensors: the slots written, pads as zeros; a KV slot never
    written may hold anything: engine.attention.softmax's docstring)."""
    assert a.slots == b.slots and a.padded == b.padded and torch.equal(a.lengths, b.lengths)
    saved_a, saved_b = a.state_dict()["tensors"], b.state_dict()["tensors"]
    assert saved_a.keys() == saved_b.keys()
    for name, y in saved_b.items():
        assert max_diff(saved_a[name], y) <= tol * max(1.0, y.float().abs().max().item()), name
    for name in ("wreal", "slot_real"):
        for p, q in zip(getattr(a, "parts", [a]), getattr(b, "parts", [b])):
            if hasattr(p, name):
                assert torch.equal(getattr(p, name), getattr(q, name))


def tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 5e-2


def tokens_for(batch, seed=1, T=PROMPT + STEPS):
    return torch.randint(1, 97, (batch, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- the static step, eager (CPU)
def test_bucket_rule():
    assert BUCKET_MIN == 256
    assert [decode_bucket(s, 10_000) for s in (0, 1, 254, 255, 256, 511, 512, 4095)] == \
        [256, 256, 256, 256, 512, 512, 1024, 4096]
    assert decode_bucket(255, 300) == 256 and decode_bucket(256, 300) == 300 and decode_bucket(299, 300) == 300
    assert decode_bucket(0, 100) == 100                          # capped by a short cache
    assert [decode_bucket(s, 64, 4) for s in (0, 3, 4, 7, 8, 40)] == [4, 4, 8, 8, 16, 64]
    for s in range(0, 700, 7):                                   # every slot attends to itself
        assert s + 1 <= decode_bucket(s, 10_000) and decode_bucket(s, 10_000) & (decode_bucket(s, 10_000) - 1) == 0
    model, _ = make_model("softmax")
    assert static_shape(model.init_state(1, 64, "linear"), 300) == (None, 512)     # no cache: no bucket
    assert static_shape(model.init_state(1, 64, "softmax"), 40, 4) == (64, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("case", list(CASES))
def test_static_step_equals_torch_step_and_module(case, batch, dtype):
    """Step by step over 24 tokens (softmax crossing three buckets): logits equal the torch step's and the
    module path's; the state after them equals theirs (slots, lengths, every tensor)."""
    model, path = make_model(case, dtype)
    tokens = tokens_for(batch)
    s_static, s_torch, s_module = (prefilled(model, path, tokens) for _ in range(3))
    torch_form = TorchStep(model)
    plan = torch_form.plan_for(tokens)
    worst_torch = worst_module = 0.0
    for t in range(PROMPT, PROMPT + STEPS):
        tok = tokens[:, t:t + 1]
        with torch.inference_mode():
            got = step_static(plan, tok, s_static, min_bucket=4)
        scale = max(1.0, got.float().abs().max().item()) if dtype != torch.float32 else 1.0
        worst_torch = max(worst_torch, max_diff(got, torch_form(tok, s_torch)) / scale)
        worst_module = max(worst_module, max_diff(got, model.step(tok, s_module)) / scale)
        assert got.dtype == dtype and got.shape == (batch, 1, model.config.vocab_size)
    print(f"{case} {dtype}: max |static - torch| {worst_torch:.2e}, |static - module| {worst_module:.2e}")
    assert worst_torch <= tolerance(dtype) and worst_module <= tolerance(dtype)
    assert_same_state(s_static, s_torch, tolerance(dtype))
    assert_same_state(s_static, s_module, tolerance(dtype))


@pytest.mark.parametrize("how", ["left-padded", "joined"])
@pytest.mark.parametrize("case", ["softmax", "linear-elu1", "window", "hybrid", "hybrid-window"])
def test_static_step_on_a_padded_batch(case, how):
    """Rows at different positions (a left-padded prompt block, or rows joined as a server does): each row
    reads its own rotary row and only its real keys."""
    model, path = make_model(case)
    tokens = tokens_for(3, seed=2)
    if how == "left-padded":
        valid = torch.ones(3, PROMPT, dtype=torch.bool)
        valid[1, :2] = valid[2, :4] = False
        s_static, s_torch = prefilled(model, path, tokens, valid), prefilled(model, path, tokens, valid)
    else:
        s_static, s_torch = joined(model, path, tokens), joined(model, path, tokens)
        for s in (s_static, s_torch):   # the slots a join leaves unwritten, at their worst
            poison_unwritten(s)
    assert s_static.padded and len(set(s_static.lengths.tolist())) == 3
    torch_form = TorchStep(model)
    plan = torch_form.plan_for(tokens)
    worst = 0.0
    for t in range(PROMPT, PROMPT + STEPS):
        tok = tokens[:, t:t + 1]
        with torch.inference_mode():
            got = step_static(plan, tok, s_static, min_bucket=4)
        worst = max(worst, max_diff(got, torch_form(tok, s_torch)))
    print(f"{case} {how}: max |static - torch| {worst:.2e}")
    assert worst <= 1e-5
    assert_same_state(s_static, s_torch, 1e-5)


def test_static_step_across_the_default_bucket_and_the_cap():
    """A 250-token prompt, then steps past slot 256 (bucket 256 -> the cache's 300 slots)."""
    model, _ = make_model("softmax")
    tokens = torch.randint(0, 97, (2, 262), generator=torch.Generator().manual_seed(3))
    s_static, s_torch = (model.init_state(2, 300, "softmax") for _ in range(2))
    for s in (s_static, s_torch):
        model.step(tokens[:, :250], s)
    torch_form = TorchStep(model)
    plan = torch_form.plan_for(tokens)
    assert {static_shape(s_static, s)[0] for s in range(250, 262)} == {256, 300}
    worst = 0.0
    for t in range(250, 262):
        with torch.inference_mode():
            got = step_static(plan, tokens[:, t:t + 1], s_static)
        worst = max(worst, max_diff(got, torch_form(tokens[:, t:t + 1], s_torch)))
    assert worst <= 1e-5
    assert_same_state(s_static, s_torch, 1e-5)


def greedy(form, model, path, prompt, n):
    state = model.init_state(prompt.shape[0], prompt.shape[1] + n + 1, attention=path)
    logits = model.step(prompt, state, last_only=True)
    ids = []
    for _ in range(n):
        tok = logits[:, -1].argmax(-1, keepdim=True)
        ids.append(tok)
        logits = form(tok, state)
    return torch.cat(ids, 1), state


@pytest.mark.parametrize("case", ["softmax", "linear-elu1", "linear-hedgehog-gated", "window", "hybrid"])
def test_greedy_ids_equal_the_torch_step(case):
    model, path = make_model(case)
    prompt = tokens_for(2, seed=3, T=6)
    plan = TorchStep(model).plan_for(prompt)

    def static(tok, state):
        with torch.inference_mode():
            return step_static(plan, tok, state, min_bucket=4)

    ids_static, _ = greedy(static, model, path, prompt, 30)
    ids_torch, _ = greedy(TorchStep(model), model, path, prompt, 30)
    assert torch.equal(ids_static, ids_torch)
    assert len(set(ids_torch.flatten().tolist())) > 3        # not one token repeated: the steps differ


def test_static_step_with_a_16_bit_cache_under_fp32_weights():
    model, _ = make_model("softmax")
    tokens = tokens_for(2, seed=5)
    s_static, s_torch = (model.init_state(2, 64, "softmax", kv_dtype=torch.float16) for _ in range(2))
    for s in (s_static, s_torch):
        model.step(tokens[:, :PROMPT], s)
    torch_form = TorchStep(model)
    plan = torch_form.plan_for(tokens)
    worst = 0.0
    for t in range(PROMPT, PROMPT + 10):
        with torch.inference_mode():
            got = step_static(plan, tokens[:, t:t + 1], s_static, min_bucket=4)
        worst = max(worst, max_diff(got, torch_form(tokens[:, t:t + 1], s_torch)))
    assert s_static.k.dtype == torch.float16 and worst <= 1e-4


def reference_attention(q, k, v, n_keys, key_real, scale):
    j = torch.arange(k.shape[2])[None, :]
    seen = j < n_keys[:, None]
    if key_real is not None:
        seen = seen & (key_real | (j == n_keys[:, None] - 1))
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=seen[:, None, None, :],
                                          scale=scale, enable_gqa=True)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_softmax_decode_equals_masked_sdpa(kv_heads):
    """Per-row key counts, pad keys masked, the query's own key seen even where key_real says pad, keys
    past n_keys (garbage here) never read; a 16-bit cache under fp32 queries."""
    g = torch.Generator().manual_seed(6)
    B, H, N, D = 3, 4, 12, 8
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, kv_heads, N, D, generator=g), torch.randn(B, kv_heads, N, D, generator=g)
    n_keys = torch.tensor([12, 7, 1])
    key_real = torch.rand(B, N, generator=g) > 0.3
    key_real[1, 6] = False                       # row 1's own key, marked pad: still seen
    scale = torch.tensor(D ** -0.5)
    for real in (None, key_real):
        want = reference_attention(q, k, v, n_keys, real, D ** -0.5)
        got = softmax_decode(q, k, v, n_keys, real, scale)
        assert got.shape == (B, H, 1, D) and got.dtype == q.dtype and max_diff(got, want) <= 1e-5
    alone = softmax_decode(q[1:2], k[1:2, :, :7], v[1:2, :, :7], n_keys[1:2], key_real[1:2, :7], scale)
    assert max_diff(alone, softmax_decode(q, k, v, n_keys, key_real, scale)[1:2]) <= 1e-6
    half = softmax_decode(q, k.half(), v.half(), n_keys, key_real, scale)
    want = reference_attention(q, k.half().float(), v.half().float(), n_keys, key_real, D ** -0.5)
    assert half.dtype == torch.float32 and max_diff(half, want) <= 1e-5
    bf = softmax_decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), n_keys, key_real, scale)
    assert bf.dtype == torch.bfloat16 and max_diff(bf, reference_attention(q, k, v, n_keys, key_real, D ** -0.5)) <= 5e-2


# ---------------------------------------------------------------------- the Stepper and the CLI (CPU)
def test_graph_is_a_backend_and_refuses_the_cpu_with_its_reason():
    assert "graph" in BACKENDS and check_backend("graph") == "graph"
    assert {"auto", "torch", "native", "module"} <= set(BACKENDS)
    model, _ = make_model("softmax")
    step, plain = Stepper(model, "graph"), Stepper(model, "torch")
    assert step.forms_available == ["graph", "torch"]
    tokens = tokens_for(1)
    a, b = model.init_state(1, 32), model.init_state(1, 32)
    step(tokens[:, :PROMPT], a, last_only=True)
    plain(tokens[:, :PROMPT], b, last_only=True)
    assert torch.equal(step(tokens[:, PROMPT:PROMPT + 1], a), plain(tokens[:, PROMPT:PROMPT + 1], b))
    assert step.last_form == "torch" and step.fallback == "graph: the graph step runs on CUDA only, not cpu"
    assert "graph" not in Stepper(model, "auto").forms_available      # auto on a CPU model: no graph form


def test_fallback_names_every_form_that_refused():
    """auto on a CUDA model runs graph, native, torch in turn: the -v line says why each faster one did not
    run (here on the CPU: the graph step for the device, the C step for float64)."""
    model = tiny_model(dtype=torch.float64)
    step = Stepper(model, "auto")
    step.forms.insert(0, GraphStep(model))
    state = model.init_state(1, 16)
    step(torch.tensor([[1, 2]]), state, last_only=True)
    step(torch.tensor([[3]]), state)
    assert step.last_form == "torch"
    graph, native = step.fallback.split("; ")
    assert graph == "graph: the graph step runs on CUDA only, not cpu"
    assert native.startswith("native: ") and "float64" in native


def test_gen_verbose_shows_the_graph_reason(small_model_dir):
    r = CliRunner().invoke(main, ["--model", str(small_model_dir), "-v", "--backend", "graph", "--temperature", "0",
                                  "--max-new-tokens", "3", "the cat"])
    assert r.exit_code == 0, r.output
    line = [s for s in r.stderr.splitlines() if "step form" in s]
    assert line == [("gen: step form: torch; forms available: graph, torch (--backend graph: each step runs on the "
                     "first that takes it); fallback: graph: the graph step runs on CUDA only, not cpu")]


# ---------------------------------------------------------------------- GraphStep's bookkeeping, CUDA stood in (CPU)
class RecordedGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: the capture records the static step's call (run once,
    the state restored after it, as a real capture leaves it untouched), a replay re-runs it into the
    captured output. What it checks is GraphStep's own logic: keys, recaptures, the kept graphs, the static
    buffers filled before a replay, and open/commit around it."""
    capturing = None

    def __init__(self):
        self.run = self.out = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        RecordedGraph.capturing = self

    def capture_end(self):
        RecordedGraph.capturing = None

    def replay(self):
        self.out.copy_(self.run())


@pytest.fixture
def recorded_graphs(monkeypatch):
    import contextlib

    import engine.steps.graph_step as gs
    real = gs.decode_static

    def decode_static(plan, tokens, state, slot, bucket, rope_rows):
        graph = RecordedGraph.capturing
        if graph is None:
            return real(plan, tokens, state, slot, bucket, rope_rows)
        saved = [t.clone() for t in gs.moving_tensors(state)]
        graph.out = real(plan, tokens, state, slot, bucket, rope_rows)
        for t, kept in zip(gs.moving_tensors(state), saved):
            t.copy_(kept)
        graph.run = lambda: real(plan, tokens, state, slot, bucket, rope_rows)
        return graph.out

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(gs, "decode_static", decode_static)
    for name, value in (("CUDAGraph", RecordedGraph), ("Stream", Stream), ("stream", lambda s: contextlib.nullcontext()),
                        ("current_stream", Stream), ("graph_pool_handle", object), ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    return gs


@pytest.mark.parametrize("case", ["softmax", "linear-hedgehog-gated", "window", "hybrid", "hybrid-window"])
@pytest.mark.parametrize("how", ["B1", "B3", "joined"])
def test_graph_step_bookkeeping_with_recorded_graphs(recorded_graphs, case, how):
    """One capture per static shape, replays after it; every step equals the torch step, and the state ends
    as the torch step leaves it."""
    model, path = make_model(case)
    tokens = tokens_for(3 if how != "B1" else 1, seed=2)
    make = (lambda: joined(model, path, tokens)) if how == "joined" else (lambda: prefilled(model, path, tokens))
    s_graph, s_torch = make(), make()
    step, torch_form = GraphStep(model, min_bucket=4), TorchStep(model)
    worst = 0.0
    for t in range(PROMPT, PROMPT + 20):
        worst = max(worst, max_diff(step(tokens[:, t:t + 1], s_graph), torch_form(tokens[:, t:t + 1], s_torch)))
    assert worst <= 1e-5 and step.broken is None
    assert step.captures == distinct_shapes(s_graph, range(PROMPT, PROMPT + 20), 4) == 3
    assert_same_state(s_graph, s_torch, 1e-5)


def test_graph_step_swaps_evicts_and_follows_new_weights(recorded_graphs):
    model, path = make_model("hybrid")
    tokens = tokens_for(3)
    step, torch_form = GraphStep(model, min_bucket=64, keep=2), TorchStep(model)
    pairs = [(prefilled(model, path, tokens[:b]), prefilled(model, path, tokens[:b])) for b in (1, 3, 2)]
    worst = 0.0
    for t in range(PROMPT, PROMPT + 4):
        for g, e in pairs[:2]:
            b = g.batch_size
            worst = max(worst, max_diff(step(tokens[:b, t:t + 1], g), torch_form(tokens[:b, t:t + 1], e)))
    assert step.captures == 2 and len(step.graphs) == 2
    g, e = pairs[2]
    worst = max(worst, max_diff(step(tokens[:2, PROMPT:PROMPT + 1], g), torch_form(tokens[:2, PROMPT:PROMPT + 1], e)))
    assert step.captures == 3 and len(step.graphs) == 2           # the least recently replayed graph went
    g, e = pairs[0]
    worst = max(worst, max_diff(step(tokens[:1, 9:10], g), torch_form(tokens[:1, 9:10], e)))
    assert step.captures == 4
    with torch.no_grad():           # new weights (the epoch moves): every graph dropped, recaptured on them
        model.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()})
    assert step.graphs
    old_pool = step.pool
    worst = max(worst, max_diff(step(tokens[:1, 10:11], g), torch_form(tokens[:1, 10:11], e)))
    assert step.captures == 5 and len(step.graphs) == 1 and worst <= 1e-5
    # a new pool: the old one was freed with its last graph (capturing into it again asserts in CUDA's allocator)
    assert step.pool is not None and step.pool is not old_pool
    for a, b in pairs:
        assert_same_state(a, b, 1e-5)


@pytest.mark.parametrize("where", ["in-the-step", "at-capture-end"])
def test_a_failed_capture_runs_the_torch_step_and_refuses_after(recorded_graphs, monkeypatch, where):
    """An op that cannot be captured (a host sync) fails the capture: that step runs the torch step on the state as
    it was before the warm-up runs, and the form refuses from then on with the error as its reason."""
    model, path = make_model("hybrid-window")
    tokens = tokens_for(2)
    s_graph, s_torch = prefilled(model, path, tokens), prefilled(model, path, tokens)
    step, torch_form = GraphStep(model), TorchStep(model)
    error = RuntimeError("operation not permitted when stream is capturing\n(a second line)")
    if where == "at-capture-end":
        def refuse(self):
            RecordedGraph.capturing = None
            raise error
        monkeypatch.setattr(RecordedGraph, "capture_end", refuse)
    else:
        route = recorded_graphs.layer_route

        def refuse(state, layers):
            if RecordedGraph.capturing is not None:
                raise error
            return route(state, layers)
        monkeypatch.setattr(recorded_graphs, "layer_route", refuse)
    got = step(tokens[:, PROMPT:PROMPT + 1], s_graph)
    assert max_diff(got, torch_form(tokens[:, PROMPT:PROMPT + 1], s_torch)) <= 1e-5
    assert_same_state(s_graph, s_torch, 1e-5)          # the warm-up runs left no trace
    assert step.broken == ("graph capture failed: RuntimeError: operation not permitted when stream is "
                           "capturing (a second line)")
    tok = tokens[:, :1].cuda() if CUDA else tokens[:, :1]
    assert step.why_not(s_graph, tok) == (step.broken if CUDA else "the graph step runs on CUDA only, not cpu")


# ---------------------------------------------------------------------- captured and replayed (CUDA)
def graph_against_eager(model, path, s_graph, s_eager, tokens, start, steps, min_bucket=8, step=None):
    """Step s_graph with a GraphStep and s_eager with the static step run eagerly; the largest logit difference."""
    step = step or GraphStep(model, min_bucket=min_bucket)
    plan = TorchStep(model).plan_for(tokens)
    worst = 0.0
    for t in range(start, start + steps):
        tok = tokens[:, t:t + 1]
        assert step.why_not(s_graph, tok) is None
        got = step(tok, s_graph)
        with torch.inference_mode():
            want = step_static(plan, tok, s_eager, min_bucket=step.min_bucket)
        worst = max(worst, max_diff(got, want))
    assert step.broken is None, step.broken
    return worst, step


def distinct_shapes(state, slots, min_bucket=8) -> int:
    return len({static_shape(state, s, min_bucket) for s in slots})


@needs_cuda
@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("case", ["softmax", "linear-elu1", "linear-hedgehog-gated", "window", "hybrid",
                                  "hybrid-window"])
def test_cuda_replay_equals_eager(case, batch):
    """20 replayed steps across two bucket changes (8 -> 16 -> 32) equal the static step run eagerly; one
    capture per shape; the state after them equals the eager one's."""
    model, path = make_model(case, device="cuda")
    tokens = tokens_for(batch).cuda()
    s_graph, s_eager = prefilled(model, path, tokens), prefilled(model, path, tokens)
    worst, step = graph_against_eager(model, path, s_graph, s_eager, tokens, PROMPT, 20)
    print(f"{case} B{batch}: max |graph - eager| {worst:.2e}, {step.captures} captures")
    assert worst <= 1e-4
    assert step.captures == distinct_shapes(s_graph, range(PROMPT, PROMPT + 20)) == 3
    assert_same_state(s_graph, s_eager, 1e-4)


@needs_cuda
@pytest.mark.parametrize("case", ["softmax", "linear-elu1", "window", "hybrid"])
def test_cuda_padded_batch_replay_equals_eager(case):
    model, path = make_model(case, device="cuda")
    tokens = tokens_for(3, seed=2).cuda()
    s_graph, s_eager = joined(model, path, tokens), joined(model, path, tokens)
    assert s_graph.padded
    worst, _ = graph_against_eager(model, path, s_graph, s_eager, tokens, PROMPT, 12)
    assert worst <= 1e-4
    assert_same_state(s_graph, s_eager, 1e-4)


@needs_cuda
def test_cuda_bf16_replay_equals_eager():
    model, path = make_model("hybrid", dtype=torch.bfloat16, device="cuda")
    tokens = tokens_for(4).cuda()
    s_graph, s_eager = prefilled(model, path, tokens), prefilled(model, path, tokens)
    worst, _ = graph_against_eager(model, path, s_graph, s_eager, tokens, PROMPT, 16)
    assert worst <= 5e-2
    assert_same_state(s_graph, s_eager, 5e-2)


@needs_cuda
def test_cuda_state_swap_recaptures_and_keeps_each_graph():
    """Two states stepped in turn (a server's batch before and after a join): one capture each, then replays
    only; a third state past the kept graphs evicts the oldest."""
    model, path = make_model("softmax", device="cuda")
    tokens = tokens_for(4).cuda()
    step = GraphStep(model, min_bucket=64, keep=2)
    pairs = [(prefilled(model, path, tokens[:b]), prefilled(model, path, tokens[:b])) for b in (1, 4, 2)]
    plan = TorchStep(model).plan_for(tokens)
    worst = 0.0
    for t in range(PROMPT, PROMPT + 6):
        for (g, e), b in zip(pairs[:2], (1, 4)):
            got = step(tokens[:b, t:t + 1], g)
            with torch.inference_mode():
                worst = max(worst, max_diff(got, step_static(plan, tokens[:b, t:t + 1], e, min_bucket=64)))
    assert worst <= 1e-4 and step.captures == 2 and len(step.graphs) == 2
    g, e = pairs[2]
    got = step(tokens[:2, PROMPT:PROMPT + 1], g)
    with torch.inference_mode():
        assert max_diff(got, step_static(plan, tokens[:2, PROMPT:PROMPT + 1], e, min_bucket=64)) <= 1e-4
    assert step.captures == 3 and len(step.graphs) == 2
    step(tokens[:1, PROMPT + 6:PROMPT + 7], pairs[0][0])        # the evicted state's graph: captured again
    assert step.captures == 4


@needs_cuda
def test_cuda_new_weight_storage_recaptures():
    """`.to()` gives the weights new storage (the model's weights_epoch moves): the old graphs read the old
    storage, so they are dropped and the step recaptured on the new weights."""
    model, path = make_model("softmax", device="cuda")
    tokens = tokens_for(2).cuda()
    s_graph, s_eager = prefilled(model, path, tokens), prefilled(model, path, tokens)
    step = GraphStep(model, min_bucket=64)
    graph_against_eager(model, path, s_graph, s_eager, tokens, PROMPT, 3, step=step)
    with torch.no_grad():
        model.to(torch.float64)
        model.to(torch.float32)
        for p in model.parameters():
            p.mul_(1.5)
    worst, _ = graph_against_eager(model, path, s_graph, s_eager, tokens, PROMPT + 3, 3, step=step)
    assert worst <= 1e-4 and step.captures == 2


@needs_cuda
@pytest.mark.parametrize("case", ["softmax", "linear-elu1", "hybrid"])
def test_cuda_greedy_ids_equal_the_torch_step(case):
    """50 greedy tokens through the Stepper: "graph" and "auto" run the graph form, with ids equal to "torch"'s."""
    model, path = make_model(case, device="cuda")
    prompt = tokens_for(2, seed=3, T=6).cuda()
    runs = {}
    for backend in ("graph", "auto", "torch"):
        step = Stepper(model, backend)
        state = model.init_state(2, 64, attention=path)
        logits = step(prompt, state, last_only=True)
        ids = []
        for _ in range(50):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            ids.append(tok)
            logits = step(tok, state)
        runs[backend] = torch.cat(ids, 1)
        if backend != "torch":
            assert step.last_form == "graph" and step.forms_available[0] == "graph", step.fallback
            assert step.fallback is None or not step.fallback.startswith("graph")
    assert torch.equal(runs["graph"], runs["torch"]) and torch.equal(runs["auto"], runs["torch"])


@needs_cuda
def test_cuda_graph_refuses_a_cpu_state_with_its_reason():
    model, _ = make_model("softmax", device="cuda")
    step = GraphStep(model)
    state = KVState.allocate(model.config, 1, 16, "cpu", torch.float32)
    assert step.why_not(state, torch.tensor([[1]], device="cuda")) == "the state is on cpu, the tokens on cuda:0"


@pytest.mark.parametrize("case", ["hybrid"])   # softmax and linear layers in one trace
def test_the_compiled_static_step_equals_the_eager_one(case, monkeypatch):
    """Backend "compiled": decode_static through torch.compile (fullgraph, so a graph break fails here,
    not silently on a GPU) gives the eager static step's logits and state, step by step. On the CPU the
    trace runs through dynamo and AOT autograd's functionalization (backend "aot_eager": where a graph
    break or an in-place write the trace cannot keep fails) but not inductor's C++ code generation (~40 s
    of compiling with a cold cache, as CI has; not the code a GPU runs either: that is Triton's, compiled
    and replayed by test_cuda_compiled_greedy_ids_equal_the_torch_step)."""
    asked = []

    def compile_(fn, **kwargs):
        asked.append(kwargs)
        return real_compile(fn, **{**kwargs, "backend": "aot_eager"})
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", compile_)
    model, path = make_model(case)
    form = GraphStep(model, compile=True)
    assert form.name == "compiled" and GraphStep(model).name == "graph"
    compiled = form._static_fn()
    assert compiled is not step_static and compiled is form._static_fn()      # built once
    assert asked == [{"fullgraph": True, "dynamic": False}]                   # the engine's own call, inductor's backend
    from engine.steps.graph_step import decode_static
    tokens = tokens_for(2, seed=5)
    plan = TorchStep(model).plan_for(tokens)
    s_eager, s_comp = prefilled(model, path, tokens[:, :PROMPT]), prefilled(model, path, tokens[:, :PROMPT])
    with torch.inference_mode():
        for t in range(PROMPT, PROMPT + 4):
            outs = []
            for fn, state in ((decode_static, s_eager), (compiled, s_comp)):
                span = state.open(tokens[:, t:t + 1])
                slot = torch.full((1,), span.start, dtype=torch.long)
                outs.append(fn(plan, tokens[:, t:t + 1], state, slot, *static_shape(state, span.start, 8)))
                state.commit(span)
            assert max_diff(*outs) <= 1e-4
    assert_same_state(s_eager, s_comp, 1e-4)


@needs_cuda
@pytest.mark.parametrize("case", ["softmax", "linear-elu1"])
def test_cuda_compiled_greedy_ids_equal_the_torch_step(case):
    """Backend "compiled" on CUDA: the compiled step is captured and replayed; 30 greedy ids equal the torch step's."""
    model, path = make_model(case, device="cuda")
    prompt = tokens_for(2, seed=3, T=6).cuda()
    runs = {}
    for backend in ("compiled", "torch"):
        step = Stepper(model, backend)
        state = model.init_state(2, 64, attention=path)
        logits = step(prompt, state, last_only=True)
        ids = []
        for _ in range(30):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            ids.append(tok)
            logits = step(tok, state)
        runs[backend] = torch.cat(ids, 1)
        if backend == "compiled":
            assert step.last_form == "compiled", step.fallback
    assert torch.equal(runs["compiled"], runs["torch"])
