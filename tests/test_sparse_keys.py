"""Window + sparse cache of hard keys + linear (`--sparse-keys`, engine.attention.sparse): the block form
against a token-at-a-time reference written from the definition, prefill + steps at every kind of
split, padded rows == each alone, saved and regrouped states, and the rules of the option."""
import pytest
import torch

from engine.attention.feature_maps import get_feature_map
from engine.attention.linear import EPS
from engine.attention.sparse import BLOCK, SparseWindowState, sparse_window_attention
from engine.errors import InvalidArgumentError
from engine.runspec import RunSpec, WindowError
from engine.steps import Stepper
from tests.conftest import check_padded_pair_alone, tiny_config, tiny_model


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def reference(q, k, v, fmap, W: int, M: int, layer=None):
    """One row (B = 1), one position at a time, from the definition: query t sees exactly the keys after
    the last decision's window and its own, the cached ones, and S, z; at every multiple e of BLOCK the
    keys before e - W + 1 that are not decided yet and the cached ones compete by self-recall error
    |v - S^T phi(k) / (z . phi(k))| (rounded to 3 decimals; among equal ones the later candidate, the
    cached ones first in the order they were kept, then the leaving ones by position); the M largest
    stay, the rest go into S, z. Maps with a decay: S, z take token t's factors before its query reads
    them (tests/test_decay.py). Plain lists, float64."""
    _, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    q, k, v = q[0].double(), k[0].double(), v[0].double()
    pk = fmap(k[None].float(), layer, "k")[0].double()
    pq = fmap(q[None].float(), layer, "q")[0].double()
    ld = fmap.decay(layer, v[None].float())                                   # None, (Hkv, F), (1, Hkv, T, F)
    factor = None if ld is None else (ld[:, None] if ld.dim() == 2 else ld[0]).double().exp()   # (Hkv, 1|T, F)
    out = torch.zeros(H, T, v.shape[-1], dtype=torch.float64)
    for h in range(Hkv):
        S, z = torch.zeros(pk.shape[-1], D, dtype=torch.float64), torch.zeros(pk.shape[-1], dtype=torch.float64)
        recent, cache = [], []
        for t in range(T):
            if factor is not None:
                g_t = factor[h, min(t, factor.shape[1] - 1)]
                S, z = g_t[:, None] * S, g_t * z
            recent.append(t)
            for g in range(G):
                qh = h * G + g
                exact = recent + cache
                s = torch.stack([q[qh, t] @ k[h, j] for j in exact]) * D ** -0.5
                a = torch.exp(s - s.max())
                num = (a[:, None] * v[h, exact]).sum(0) + pq[qh, t] @ S
                den = a.sum() + pq[qh, t] @ z
                out[qh, t] = num / (den + EPS)
            e = t + 1
            if e % BLOCK == 0:
                leaving = [j for j in recent if j < e - W + 1]
                recent = [j for j in recent if j >= e - W + 1]
                cand = cache + leaving
                err = {j: round((v[h, j] - (pk[h, j] @ S) / (pk[h, j] @ z + EPS)).norm().item(), 3) for j in cand}
                cache = sorted(cand, key=lambda j: (-err[j], -cand.index(j)))[:M]
                for j in cand:
                    if j not in cache:
                        S = S + torch.outer(pk[h, j], v[h, j])
                        z = z + pk[h, j]
    return out[None]


@pytest.mark.parametrize("W,M", [(5, 3), (1, 0), (70, 2)], ids=["W5-M3", "W1-M0", "W70-M2"])
def test_block_form_equals_the_definition(W, M):
    g = torch.Generator().manual_seed(W + M)
    T = 2 * BLOCK + 40
    q, k, v = torch.randn(1, 4, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)
    fmap = get_feature_map("elu1")
    assert max_diff(sparse_window_attention(q, k, v, fmap, W, M), reference(q, k, v, fmap, W, M)) <= 1e-5


def test_a_cache_as_long_as_the_sequence_is_softmax_attention():
    """Nothing goes into the state when the cache can hold every key: exact causal softmax attention."""
    g = torch.Generator().manual_seed(0)
    T = 2 * BLOCK + 10
    q, k, v = torch.randn(1, 4, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)
    soft = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    assert max_diff(sparse_window_attention(q, k, v, get_feature_map("elu1"), 3, T), soft) <= 1e-5
    short = sparse_window_attention(q, k, v, get_feature_map("elu1"), 3, 2)
    assert max_diff(short, soft) > 1e-3   # with a small cache the state serves the rest


@pytest.mark.parametrize("fmap,kv", [("hedgehog", 2), ("elu1", 4)], ids=["hedgehog-GQA", "elu1-MHA"])
def test_prefill_then_steps_equals_the_full_sequence_at_every_kind_of_split(fmap, kv):
    """Decisions fall at the row's own positions, so one block, a prefix + steps, and chunks all agree."""
    model = tiny_model(num_key_value_heads=kv, window=5, sparse_keys=3, feature_map=fmap)
    T = 2 * BLOCK + 20
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens, "linear")
        whole = model.init_state(1, None, "linear")
        assert isinstance(whole, SparseWindowState)
        assert max_diff(model.step(tokens, whole), full) <= 1e-5
        for split in (1, BLOCK - 1, BLOCK, BLOCK + 1, T - 1):
            state = model.init_state(1, None, "linear")
            outs = [model.step(tokens[:, :split], state)] + [model.step(tokens[:, i:i + 1], state) for i in range(split, T)]
            assert max_diff(torch.cat(outs, 1), full) <= 1e-5
            assert torch.equal(state.cuse, whole.cuse)
            assert max_diff(state.S, whole.S) <= 1e-4 * whole.S.abs().max().item()
        chunks = model.init_state(1, None, "linear")
        outs = [model.step(tokens[:, i:i + 37], chunks) for i in range(0, T, 37)]
        assert max_diff(torch.cat(outs, 1), full) <= 1e-5
    assert bool(whole.cuse.all())   # past two decisions every cache slot holds a key


@pytest.mark.parametrize("backend", ["torch", "module", "auto"])
def test_padded_batch_equals_each_alone(backend):
    """Rows decide at their own positions whatever their pads: a batch row equals its run alone."""
    model = tiny_model(num_key_value_heads=2, window=4, sparse_keys=2, feature_map="hedgehog")
    step = Stepper(model, backend)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 97, (BLOCK + 9,), generator=g).tolist(), torch.randint(0, 97, (BLOCK - 3,), generator=g).tolist()
    check_padded_pair_alone(model, step, a, b, 8)


def test_hybrid_saved_and_regrouped_states_continue_the_same():
    model = tiny_model(num_hidden_layers=3, num_key_value_heads=2, window=3, sparse_keys=2, feature_map="hedgehog",
                       attention="hybrid", layer_attention=("linear", "softmax", "linear"))
    tokens = torch.randint(0, 97, (1, BLOCK + 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        state = model.init_state(1, 200)
        model.step(tokens, state)
        assert isinstance(state.parts[-1], SparseWindowState)
        sd = state.state_dict()
        from engine.attention import STATES, saved_state_class
        again = saved_state_class(sd["meta"], STATES).from_state_dict(sd, max_len=200,
                                                                      feature_map=model.feature_map("hedgehog"))
        two = state.select_rows([0, 0])
        nxt = torch.tensor([[5]])
        want = model.step(nxt, state)
        assert max_diff(model.step(nxt, again), want) <= 1e-6
        got = model.step(torch.tensor([[5], [5]]), two)
        assert max_diff(got[0], want[0]) <= 1e-6 and max_diff(got[1], want[0]) <= 1e-6


def test_the_state_is_constant_in_the_context():
    model = tiny_model(num_key_value_heads=2, window=8, sparse_keys=4)
    state = model.init_state(1, None, "linear")
    before = state.nbytes
    with torch.no_grad():
        model.step(torch.randint(0, 97, (1, 3 * BLOCK)), state)
    cfg = model.config
    D, Hkv, L = cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers
    assert state.nbytes == before == L * Hkv * ((D * D + D) * 4 + 2 * (8 + BLOCK - 1 + 4) * D * 4)


SPARSE_NATIVE = {
    "W3-M2-GQA-hedgehog": dict(window=3, sparse_keys=2, feature_map="hedgehog"),
    "W5-M4-MHA-elu1": dict(window=5, sparse_keys=4, num_key_value_heads=4),
    "W4-M3-hybrid-hedgehog": dict(window=4, sparse_keys=3, feature_map="hedgehog", attention="hybrid",
                                  num_hidden_layers=3, layer_attention=("linear", "softmax", "linear")),
    "W6-M2-bf16": dict(window=6, sparse_keys=2, dtype=torch.bfloat16),
}


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("case", SPARSE_NATIVE)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_native_step_equals_module_path_across_decisions(case, padded):
    """The C step runs one-token steps of sparse states (alone and in a hybrid) and leaves the decisions
    to SparseWindowState.decide_rows: 70 steps from a 7-token prompt (rows at their own positions when
    padded, so they cross a decision at different steps) equal the module path, batch of 3; the cache
    and S agree after. bf16: keys and values kept in bf16 on both sides (3e-2, as test_window), 40
    steps, before any decision: the forms' keys differ in bf16's last bits, which may turn a near tie of
    two errors (their choice is exact only as far as the values are)."""
    from tests.conftest import native_after_prefill, prompt_and_follow
    cfg = dict(SPARSE_NATIVE[case])
    dtype = cfg.pop("dtype", torch.float32)
    model = tiny_model(**{"attention": "linear", "num_key_value_heads": 2, **cfg}).to(dtype)
    prompt, real, follow = prompt_and_follow(11, padded, follow=BLOCK + 6 if dtype == torch.float32 else 40)
    ref, fast, a, b = native_after_prefill(model, prompt, real, follow, 100)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert max_diff(a, b) <= tol
    lin_ref, lin_fast = (s.parts[-1] if s.path == "hybrid" else s for s in (ref, fast))
    assert bool(lin_ref.cuse.any()) == (dtype == torch.float32) and torch.equal(lin_ref.cuse, lin_fast.cuse)
    assert max_diff(lin_ref.S, lin_fast.S) <= tol * (1 + lin_ref.S.abs().max().item())


def test_the_option_needs_a_window():
    cfg = tiny_config(window=0)
    with pytest.raises(WindowError, match="--sparse-keys 4 .* no window"):
        RunSpec.resolve(cfg, attention="linear", sparse_keys=4)
    with pytest.raises(WindowError, match=r"no linear layers \(use --attention linear or hybrid with --window W\)"):
        RunSpec.resolve(cfg, attention="softmax", sparse_keys=4)   # a softmax run refuses --window: not the fix
    with pytest.raises(InvalidArgumentError, match="integer >= 0"):
        RunSpec.resolve(cfg, attention="linear", window=4, sparse_keys=-1)
    assert RunSpec.resolve(cfg, attention="linear", window=4, sparse_keys=4).sparse_keys == 4
    assert RunSpec.resolve(cfg, attention="linear", window=4).sparse_keys == 0
    own = tiny_config(window=4, sparse_keys=8, attention="linear")
    assert RunSpec.resolve(own).sparse_keys == 8                    # the config's own mode keeps its cache
    assert RunSpec.resolve(own, sparse_keys=0).sparse_keys == 0     # switched off
    assert RunSpec.resolve(own, attention="linear", window=16).sparse_keys == 0   # an explicit mode names its own


def test_cli_refuses_sparse_keys_without_a_window_in_one_line():
    from click.testing import CliRunner
    from cli.main import main
    r = CliRunner().invoke(main, ["--model", "tiny", "--attention", "linear", "--sparse-keys", "4", "-n", "2", "hi"])
    assert r.exit_code == 2, r.output
    err = r.stderr if hasattr(r, "stderr") else r.output
    assert "--sparse-keys" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    r = CliRunner().invoke(main, ["--model", "tiny", "--attention", "linear", "--window", "4", "--sparse-keys", "4",
                                  "-n", "3", "--temperature", "0", "--json", "hi"])
    assert r.exit_code == 0, r.output


def test_api_batch_of_prompts_equals_each_alone():
    """`generate` on a padded batch (prompts of different lengths crossing decisions at different steps)."""
    from engine import load
    llm = load("tiny", attention="linear", window=8, sparse_keys=4, backend="auto")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (BLOCK + 6, 2 * BLOCK - 20, 9)]
    together = llm.generate(prompts, max_new_tokens=40, temperature=0)
    for p, r in zip(prompts, together):
        assert llm.generate([p], max_new_tokens=40, temperature=0)[0].ids == r.ids


def test_bench_reaches_a_depth_by_moving_the_counters():
    """gen bench's --prefill-tokens: a sparse state extended from a prefill to a deep context steps on
    (for timing: its recent keys are read as many as a row that deep holds)."""
    from engine.bench.depth import extend_to_depth
    model = tiny_model(num_key_value_heads=2, window=4, sparse_keys=2, max_position_embeddings=4096)
    state = model.init_state(1, None, "linear")
    with torch.no_grad():
        model.step(torch.randint(0, 97, (1, 2 * BLOCK)), state)
        extend_to_depth(state, 3000)
        assert int(state.held_counts()[0]) == 3000 % BLOCK + 4 - 1
        assert torch.isfinite(model.step(torch.tensor([[5]]), state)).all()


@pytest.mark.usefixtures("small_copy_buffer")   # tests/conftest.py: the floor is not checked here
def test_gen_bench_runs_sparse_keys_and_its_state_formula_holds(tmp_path):
    import json
    from click.testing import CliRunner
    from cli.main import main
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "--model", "tiny", "--attention", "window", "--window", "4", "--sparse-keys",
                                  "2", "--contexts", "80", "--steps", "2", "--warmup", "0", "--no-isolate", "--quiet",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())["results"][0]
    assert rec["configuration"] == "linear + window 4 + 2 sparse keys" and rec["sparse_keys"] == 2
    assert rec["state_bytes"] == rec["state_bytes_formula"]
    assert "sparse" in json.loads(out.read_text())["summary"]["state_formulas"]["per layer"]   # the legend says it
    r = CliRunner().invoke(main, ["bench", "--model", "tiny", "--attention", "softmax", "--sparse-keys", "2"])
    assert r.exit_code == 2 and "--sparse-keys applies to linear layers with a window" in r.output


def test_the_graph_step_leaves_a_hybrid_with_a_sparse_cache_to_the_torch_step():
    """The CUDA graph form knows KV, linear, window and hybrid states; a hybrid whose linear layers keep a
    sparse cache decides in Python every 64 tokens (nothing a captured graph can replay) and has none of
    the window's buffers: the graph form refuses it with its reason (on any device, as it refuses a
    sliding KV cache), so the torch step runs it, instead of the capture raising AttributeError."""
    from engine.steps.graph_step import GraphStep
    from engine.steps.torch_step import TorchStep
    model = tiny_model(num_hidden_layers=3, num_key_value_heads=2, window=3, sparse_keys=2, attention="hybrid",
                       layer_attention=("linear", "softmax", "linear"))
    state = model.init_state(1, 100)
    assert isinstance(state.parts[-1], SparseWindowState)
    reason = GraphStep(model, TorchStep(model)).why_not(state, torch.tensor([[5]]))
    assert reason is not None and "sparse" in reason


def test_the_page_names_the_servers_sparse_cache_where_its_panes_differ_by_it():
    """A request's own attention or window runs without the server's sparse cache (an explicit mode names
    its own; a request has no sparse_keys field): the page's default pane says the cache it runs, so the
    default and the "linear + window W" pane (the same run minus the cache) are told apart."""
    from engine.api import load
    from engine.serve import Server
    from engine.serve.page import page_config
    llm = load("tiny", attention="linear", window=4, sparse_keys=2)
    offered = {c["id"]: c for c in page_config(Server(llm, "tiny"))["configurations"]}
    assert "2 sparse keys" in offered["default"]["label"] and "sparse" not in offered["linear"]["label"]
    spec = llm.spec.for_request(llm.model.config, offered["linear"]["attention"], None, offered["linear"]["window"])
    assert spec.sparse_keys == 0 and llm.spec.sparse_keys == 2


def test_a_server_request_names_its_sparse_keys(small_model_dir):
    """`sparse_keys` in a request, alone (the server's mode with that many) or with its own window: the
    greedy text of `load(..., sparse_keys=M)`; without a window, or negative, a 400 naming the field."""
    httpx = pytest.importorskip("httpx")
    from engine.api import load
    from engine.serve import Server
    from test_serve_support import NAME, LiveServer
    srv = LiveServer(Server(load(str(small_model_dir), attention="linear", window=4), NAME))
    prompt = "the cat sat on the mat and then " * 2   # ~56 tokens: the decision at 64 falls in the generation
    try:
        for extra, want in (({"sparse_keys": 2}, dict(window=4, sparse_keys=2)),
                            ({"attention": "linear", "window": 6, "sparse_keys": 3}, dict(window=6, sparse_keys=3)),
                            ({}, dict(window=4))):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **extra}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            alone = load(str(small_model_dir), attention="linear", **want)
            assert r.json()["choices"][0]["text"] == alone.generate(prompt, max_new_tokens=20, temperature=0,
                                                                    ignore_eos=True).text
        for extra in ({"attention": "softmax", "sparse_keys": 2}, {"sparse_keys": -1}):
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "hi", **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "sparse_keys", r.text
    finally:
        srv.stop()


def native_prompt_then_steps(hybrid: bool, chunk: int, tokens: int, follow: int, seed: int, **cfg):
    """A `tokens`-token prompt read by the C step in blocks of `chunk` tokens (0: one), then `follow`
    native steps, against the module path on a twin state (tiny model, window 5, learned maps; hybrid:
    layers linear, softmax, linear). Returns (model, module state, native state)."""
    from tests.conftest import module_and_native_steps
    extra = dict(attention="hybrid", num_hidden_layers=3, layer_attention=("linear", "softmax", "linear")) \
        if hybrid else dict(attention="linear")
    model = tiny_model(num_key_value_heads=2, window=5, feature_map="hedgehog", max_position_embeddings=512,
                       **extra, **cfg)
    g = torch.Generator().manual_seed(seed)
    prompt, rest = torch.randint(0, 97, (1, tokens), generator=g), torch.randint(0, 97, (1, follow), generator=g)
    step = Stepper(model, "native", threads=2, prefill_chunk=chunk)
    ref, fast = model.init_state(1, 256), model.init_state(1, 256)
    with torch.no_grad():
        want = model.step(prompt, ref)[:, -1]
        got = step(prompt, fast, last_only=True)[:, -1]
        assert step.last_prefill_form == "native"
        assert max_diff(got, want) <= 1e-4
        a, b = module_and_native_steps(model, step, ref, fast, rest)
    assert max_diff(a, b) <= 1e-4
    return model, prompt, ref, fast


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("chunk", [0, 16, 37], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("hybrid", [False, True], ids=["linear", "hybrid"])
def test_native_prompt_blocks_split_at_the_decisions(chunk, hybrid):
    """A 150-token prompt read by the C step (in blocks of `chunk` tokens, split at every 64th position
    where the decisions run in between), then 20 native steps: the module path's logits, cache and S."""
    _, _, ref, fast = native_prompt_then_steps(hybrid, chunk, 150, 20, 7, sparse_keys=3)
    lin_ref, lin_fast = (s.parts[-1] if s.path == "hybrid" else s for s in (ref, fast))
    assert torch.equal(lin_ref.cuse, lin_fast.cuse) and bool(lin_ref.cuse.all())
    assert max_diff(lin_ref.S, lin_fast.S) <= 1e-4 * (1 + lin_ref.S.abs().max().item())


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("chunk", [16, 37, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("hybrid", [False, True], ids=["linear", "hybrid"])
def test_native_prompt_blocks_of_plain_window_states(chunk, hybrid):
    """Without a sparse cache: blocks of at most 64 tokens run on the C step (row r reads the pad mask
    r slots on), longer ones on the module path; both then step natively as the module path does."""
    model, prompt, _, _ = native_prompt_then_steps(hybrid, chunk, 90, 12, 8)
    whole = Stepper(model, "native", threads=2, prefill_chunk=0)
    with torch.no_grad():
        whole(prompt, model.init_state(1, 256), last_only=True)
    assert whole.last_prefill_form == "module"   # 90 tokens in one block: over 64


@pytest.mark.usefixtures("native_built")
def test_decisions_left_to_the_state_record_no_autograd_history():
    """The server's loop runs the C step with autograd on (a thread's default); the decisions it leaves to
    the state (decide_rows) run learned maps, whose parameters require grad: S and z must not carry a
    graph (a 1,000-token prompt's kept ~100 MB of activations alive through its prefix cache entry)."""
    model = tiny_model(attention="linear", num_key_value_heads=2, window=4, sparse_keys=2, feature_map="hedgehog")
    assert torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    step = Stepper(model, "native", threads=2)
    state = model.init_state(1, 200)
    logits = step(torch.randint(0, 97, (1, 70)), state, last_only=True)
    for _ in range(BLOCK):   # across the decision at 128
        logits = step(logits[:, -1].argmax(-1)[:, None], state)
    assert step.last_form == "native" and state.cuse.any()
    assert not any(t.requires_grad for t in state.tensors())
