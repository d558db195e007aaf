"""A learned decay on the hedgehog maps (`gen linearize --decay`): S_i = diag(g) S_{i-1} + phi(k_i) v_i^T,
z_i = g z_{i-1} + phi(k_i), constant per key/value head and feature or gated (`--gate`: g_i read from the
token's value). Recurrence == chunked prefill == naive form at every split, GQA, pads; the native step runs
it as the module path does; the maps round-trip through safetensors and load. The window forms (window +
linear, window + sparse cache) run it too: a key decays from the token it leaves the window at."""
import copy
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import main
from engine.attention.linear import CHUNK
from engine.errors import InvalidArgumentError
from engine.linearize import linearize
from engine.loader import load_model
from engine.steps import Stepper
from models.linearized import read_maps, write_maps
from tests.conftest import check_every_split, tiny_model
from tests.test_linearize import args, corpus  # noqa: F401 - the module-scoped text fixture


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def decay_model(seed=0, gated=False, **cfg):
    """A tiny hedgehog model whose decay is strong and different per layer, head and feature
    (factors from ~0.4 to ~1), so that it changes every output; gated: and per token, by a gate
    that moves the logits by ~1 from token to token."""
    model = tiny_model(seed=seed, feature_map="hedgehog", **cfg)
    model.hedgehog.add_gate() if gated else model.hedgehog.add_decay()
    g = torch.Generator().manual_seed(seed + 200)
    with torch.no_grad():
        model.hedgehog.decay_logit.copy_(torch.randn(model.hedgehog.decay_logit.shape, generator=g) * 2 - 1)
        if gated:
            D = model.config.head_dim
            model.hedgehog.gate_weight.copy_(torch.randn(model.hedgehog.gate_weight.shape, generator=g) / D ** 0.5)
    return model


def without_decay(model):
    plain = copy.deepcopy(model)
    plain.hedgehog.decay_logit = plain.hedgehog.gate_weight = None
    return plain


GATED = pytest.mark.parametrize("gated", [False, True], ids=["constant", "gated"])


@GATED
def test_decay_changes_the_output_and_costs_no_state(gated):
    model = decay_model(num_key_value_heads=2, gated=gated)
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(model(tokens, "linear"), without_decay(model)(tokens, "linear")) > 1e-2
    assert model.init_state(2, None, "linear").nbytes == without_decay(model).init_state(2, None, "linear").nbytes
    F = 2 * model.config.head_dim
    v = torch.randn(3, 2, 5, model.config.head_dim)
    ld = model.hedgehog.decay(0, v)
    assert ld.shape == ((3, 2, 5, F) if gated else (2, F)) and (ld < 0).all() and (ld > -1).all()
    if gated:   # by token: each token's own factors, and no decay without the values it depends on
        assert max_diff(ld[:, :, 0], ld[:, :, 1]) > 1e-2
        with pytest.raises(ValueError, match="values"):
            model.hedgehog.decay(0)


def test_a_fresh_gate_is_the_constant_decay():
    """`--gate` on maps with a decay starts where they are: a zero gate changes nothing."""
    model = decay_model(num_key_value_heads=2)
    gated = copy.deepcopy(model)
    gated.hedgehog.add_gate()
    assert gated.hedgehog.has_gate and not model.hedgehog.has_gate
    tokens = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert max_diff(model(tokens, "linear"), gated(tokens, "linear")) <= 1e-6


@GATED
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_steps_equal_prefill_equal_naive_at_every_split(kv_heads, gated):
    """T spans two chunks, so the chunked form carries a decayed state across a chunk boundary."""
    model = decay_model(num_hidden_layers=1, num_key_value_heads=kv_heads, gated=gated)
    tokens = torch.randint(0, 97, (2, CHUNK + 6), generator=torch.Generator().manual_seed(3))
    check_every_split(model, tokens)


@GATED
def test_padded_batch_equals_each_alone(gated):
    """Pads neither add to the state nor decay it: a left-padded row equals the row alone, in a
    prompt block after a first one (so there is a state for the pads to wrongly decay)."""
    model = decay_model(num_key_value_heads=2, gated=gated)
    first = torch.tensor([[5, 6, 7], [8, 9, 10]])
    a, b = [11, 12, 13, 14, 15, 16], [17, 18]
    batch = torch.tensor([a, [0] * 4 + b])
    real = torch.tensor([[True] * 6, [False] * 4 + [True] * 2])
    state = model.init_state(2, None, "linear")
    model.step(first, state)
    out = model.step(batch, state, valid=real)
    nxt = model.step(torch.tensor([[20], [21]]), state)
    for row, ids, tok in ((0, a, 20), (1, b, 21)):
        alone = model.init_state(1, None, "linear")
        model.step(first[row:row + 1], alone)
        o = model.step(torch.tensor([ids]), alone)
        n = model.step(torch.tensor([[tok]]), alone)
        assert max_diff(out[row, -1], o[0, -1]) <= 1e-5
        assert max_diff(nxt[row], n[0]) <= 1e-5


@pytest.mark.usefixtures("native_built")
@GATED
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_native_steps_equal_module(kv_heads, dtype, gated):
    """One-token steps (and, in fp32, the prompt block) on the native step against the module path in
    fp32 on the same values; a hybrid's linear layers too."""
    model = decay_model(num_key_value_heads=kv_heads, gated=gated).to(dtype)
    reference = copy.deepcopy(model).float()
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(7))
    runs = [("linear", {}), ("hybrid", {"layer_attention": ("softmax", "linear")})]
    for attention, extra in runs if dtype == torch.float32 else runs[:1]:   # (a 16-bit model's KV cache is 16-bit)
        for m in (model, reference):
            m.config = m.config.replace(**extra) if extra else m.config
        ref, fast = reference.init_state(2, None, attention), model.init_state(2, None, attention)
        step = Stepper(model, "native", threads=2)
        a = [reference.step(tokens[:, :6], ref)[:, -1]]
        if dtype == torch.float32:    # the prompt block natively too
            b = [step(tokens[:, :6], fast)[:, -1]]
        else:                         # (a 16-bit model's native prompt block rounds as the module's does not)
            fast.load_state_dict(ref.state_dict())
            b = [a[0]]
        for t in tokens[:, 6:].T:
            a.append(reference.step(t[:, None], ref)[:, -1])
            b.append(step(t[:, None], fast)[:, -1])
            assert step.last_form == "native", step.fallback
        assert max_diff(torch.stack(a), torch.stack(b)) <= 1e-4
        lin = fast if attention == "linear" else fast.parts[-1]
        ref_lin = ref if attention == "linear" else ref.parts[-1]
        assert max_diff(ref_lin.S, lin.S) <= 1e-5 * ref_lin.S.abs().max().item()


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("edit", ["decay", "gate"])
def test_native_step_follows_an_edited_decay(edit):
    """The plan's decay factors (a gated decay's logits and gate, from 16-bit maps) are copied once; an
    in-place edit of the logits (of the gate) rebuilds them."""
    model = decay_model(num_key_value_heads=2, gated=edit == "gate")
    if edit == "gate":
        model.hedgehog.half()    # (fp32 maps are read in place: no copy to go stale)
    tokens = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(2))
    step = Stepper(model, "native")
    state = model.init_state(1, None, "linear")
    step(tokens[:, :3], state)
    step(tokens[:, 3:4], state)          # a one-token step: the plan is made
    assert step.last_form == "native", step.fallback
    with torch.no_grad():
        (model.hedgehog.gate_weight.mul_(-3) if edit == "gate" else model.hedgehog.decay_logit.add_(1.5))
    ref = model.init_state(1, None, "linear")
    ref.load_state_dict(state.state_dict())
    for i in range(4, 8):
        assert max_diff(step(tokens[:, i:i + 1], state), model.step(tokens[:, i:i + 1], ref)) <= 1e-5


@GATED
def test_maps_round_trip_through_safetensors_and_build(tmp_path, gated):
    model = decay_model(num_key_value_heads=2, gated=gated)
    runtime = {f"hedgehog.{k}": v for k, v in model.hedgehog.state_dict().items()}
    assert "hedgehog.decay_logit" in runtime and ("hedgehog.gate_weight" in runtime) == gated
    write_maps(tmp_path / "maps.safetensors", runtime, dtype=torch.float32)
    back = read_maps(tmp_path / "maps.safetensors", model.config)
    assert set(back) == set(runtime) and all(torch.equal(back[k], runtime[k]) for k in runtime)
    with pytest.raises(Exception, match="belong to another model"):
        read_maps(tmp_path / "maps.safetensors", model.config.replace(num_key_value_heads=4))


def window_inputs(T, seed, kv=2, pads=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, T, 16, generator=g) for h in (4, kv, kv))
    valid = torch.ones(2, T, dtype=torch.bool)
    if pads:
        valid[1, :T // 3] = False
    return q, k, v, valid


@GATED
@pytest.mark.parametrize("W,T", [(1, 9), (5, 2 * CHUNK + 5), (CHUNK + 3, CHUNK + 70)], ids=["W1-T9", "W5-T133", "W67-T134"])
def test_window_block_form_equals_the_definition(W, T, gated):
    """Window + linear with a decay: a key decays from the token it leaves the window at (the naive form
    weighs key j at query t by e^{c_t - c_{j+W}}); pads neither add nor decay; the decay changes the output."""
    from engine.attention.window import window_attention, window_linear_reference
    fm = decay_model(num_key_value_heads=2, gated=gated).hedgehog
    q, k, v, valid = window_inputs(T, W * 7 + T)
    got, want = window_attention(q, k, v, fm, W, valid, layer=1), window_linear_reference(q, k, v, fm, W, valid, layer=1)
    real = valid[1]
    assert max_diff(got[0], want[0]) <= 1e-5 and max_diff(got[1][:, real], want[1][:, real]) <= 1e-5
    plain = without_decay(decay_model(num_key_value_heads=2, gated=gated)).hedgehog
    if T > W + 1:
        assert max_diff(got[0], window_attention(q, k, v, plain, W, valid, layer=1)[0]) > 1e-3


@GATED
@pytest.mark.parametrize("W,M", [(5, 3), (70, 2)], ids=["W5-M3", "W70-M2"])
def test_sparse_block_form_equals_the_definition(W, M, gated):
    """Window + sparse cache with a decay against the token-at-a-time definition (tests/test_sparse_keys.py's,
    which decays S, z by token t's factors before its query reads them), across decisions."""
    from engine.attention.sparse import BLOCK, sparse_window_attention
    from tests.test_sparse_keys import reference
    fm = decay_model(num_key_value_heads=2, gated=gated).hedgehog
    q, k, v, _ = window_inputs(2 * BLOCK + 40, W + M, pads=False)
    q, k, v = q[:1], k[:1], v[:1]
    got = sparse_window_attention(q, k, v, fm, W, M, layer=1)
    assert max_diff(got, reference(q, k, v, fm, W, M, layer=1)) <= 1e-5
    assert max_diff(got, sparse_window_attention(q, k, v, without_decay(decay_model(num_key_value_heads=2)).hedgehog,
                                                 W, M, layer=1)) > 1e-3


WINDOWED = {"window": dict(window=5), "window-sparse": dict(window=5, sparse_keys=3)}


@GATED
@pytest.mark.parametrize("form", WINDOWED)
def test_window_forms_prefill_then_steps_equal_the_whole_sequence(form, gated):
    """Window and window + sparse cache with a decay: one block, a prefix + one-token steps (across the
    sparse cache's decisions), and chunks give the same outputs and state; with the decay off they differ."""
    model = decay_model(num_key_value_heads=2, gated=gated, **WINDOWED[form])
    T = 2 * CHUNK + 20
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens, "linear")
        if form == "window":
            assert max_diff(full, model(tokens, "linear", reference=True)) <= 1e-5
        assert max_diff(full, without_decay(model)(tokens, "linear")) > 1e-3
        whole = model.init_state(1, None, "linear")
        assert max_diff(model.step(tokens, whole), full) <= 1e-5
        for split in (1, CHUNK - 1, CHUNK + 1):
            state = model.init_state(1, None, "linear")
            outs = [model.step(tokens[:, :split], state)] + [model.step(tokens[:, i:i + 1], state) for i in range(split, T)]
            assert max_diff(torch.cat(outs, 1), full) <= 1e-5
            assert max_diff(state.S, whole.S) <= 1e-5 * whole.S.abs().max().item()
        chunks = model.init_state(1, None, "linear")
        assert max_diff(torch.cat([model.step(tokens[:, i:i + 37], chunks) for i in range(0, T, 37)], 1), full) <= 1e-5


@GATED
@pytest.mark.parametrize("form", WINDOWED)
def test_window_forms_padded_batch_equals_each_alone(form, gated):
    """Pads neither add to a window state nor decay it: a left-padded row equals the row alone."""
    from tests.conftest import check_padded_pair_alone
    model = decay_model(num_key_value_heads=2, gated=gated, **WINDOWED[form])
    check_padded_pair_alone(model, Stepper(model, "torch"), list(range(5, 5 + 14)), [3, 4, 5, 6], 8)


@GATED
def test_window_pads_leave_a_filled_state_undecayed(gated):
    """A block of pads over a state that holds keys (and a window of pads: nothing leaves it into the
    state) leaves S and z as they were: pads take no decay factors; real tokens do."""
    from engine.attention.window import window_linear_attention
    fm = decay_model(num_key_value_heads=2, gated=gated).hedgehog
    g = torch.Generator().manual_seed(12)
    W, T = 5, 3      # T <= W: only the window's buffered keys (pads) could enter the state
    q, keys, values = torch.randn(2, 4, T, 16, generator=g), torch.randn(2, 2, W + T, 16, generator=g), \
        torch.randn(2, 2, W + T, 16, generator=g)
    S, z = torch.rand(2, 2, 32, 16, generator=g), torch.rand(2, 2, 32, generator=g)
    key_real = torch.zeros(2, W + T, dtype=torch.bool)
    key_real[1, W:] = True          # row 1: its block is real (its window's keys are pads: none folds in)
    _, S_new, z_new = window_linear_attention(q, keys, values, key_real, fm, 0, S, z)
    assert torch.equal(S_new[0], S[0]) and torch.equal(z_new[0], z[0])
    assert (z_new[1] < z[1]).all() and max_diff(S_new[1], S[1]) > 1e-3


@pytest.mark.usefixtures("native_built")
@GATED
@pytest.mark.parametrize("form", WINDOWED)
@pytest.mark.parametrize("hybrid", [False, True], ids=["linear", "hybrid"])
def test_native_window_steps_equal_module(form, hybrid, gated):
    """The C step decays window and sparse states as the module path does: 70 one-token steps from a
    left-padded prompt (across the sparse cache's decisions), batch of 3; S agrees after."""
    from tests.conftest import native_after_prefill, prompt_and_follow
    extra = dict(attention="hybrid", num_hidden_layers=3, layer_attention=("linear", "softmax", "linear")) if hybrid \
        else dict(attention="linear")
    model = decay_model(num_key_value_heads=2, gated=gated, **WINDOWED[form], **extra)
    prompt, real, follow = prompt_and_follow(11, True, follow=CHUNK + 6)
    ref, fast, a, b = native_after_prefill(model, prompt, real, follow, 100)
    assert max_diff(a, b) <= 1e-4
    lin_ref, lin_fast = (s.parts[-1] if s.path == "hybrid" else s for s in (ref, fast))
    assert lin_ref.path == "window" and lin_ref.S.abs().max() > 0
    assert max_diff(lin_ref.S, lin_fast.S) <= 1e-4 * (1 + lin_ref.S.abs().max().item())
    step = Stepper(model, "native", threads=2, prefill_chunk=16)   # prompt blocks natively too, across a decision
    tokens = torch.randint(0, 97, (1, CHUNK + 20), generator=torch.Generator().manual_seed(8))
    state, want = model.init_state(1, 128), model.init_state(1, 128)
    with torch.no_grad():
        assert max_diff(step(tokens, state, last_only=True)[:, -1], model.step(tokens, want)[:, -1]) <= 1e-4
    assert step.last_prefill_form == "native", step.fallback


def interrupted_then_resumed(model_dir, corpus, out, **kw):  # noqa: F811
    """`gen linearize` into `out` stopped by Ctrl-C at finetune step 3, then `--resume`d: its maps file."""
    def interrupt(phase, layer, step):
        if (phase, layer, step) == ("finetune", None, 3):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        linearize(args(model_dir, corpus, out, **kw), log=lambda m: None, on_step=interrupt)
    linearize(args(model_dir, corpus, out, resume=True, **kw), log=lambda m: None)
    return load_file(out / "maps.safetensors")


def test_linearize_decay_learns_writes_and_loads(small_model_dir, corpus, tmp_path):  # noqa: F811
    """--decay: the finetune moves the decay logits (at --decay-lr), the maps file holds them, the output
    loads with them (also to run with a window, decayed), and --resume after an interrupt gives the same
    file; --decay with --window trains the window form's decay."""
    out = tmp_path / "lin"
    linearize(args(small_model_dir, corpus, out, decay=True, decay_lr=0.5), log=lambda m: None)
    maps = load_file(out / "maps.safetensors")
    cfg = load_model(small_model_dir)[0].config
    assert maps["feature_map.decay"].shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, 2 * cfg.head_dim)
    assert (maps["feature_map.decay"].float() - -8.0).abs().max() > 0.5    # moved from the fresh -8
    model, _ = load_model(out)
    assert model.hedgehog.decay_logit is not None
    assert torch.equal(model.hedgehog.decay_logit, maps["feature_map.decay"].float())
    windowed = load_model(out, configure=lambda c: c.replace(window=8))[0]
    tokens = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(windowed(tokens, "linear"), without_decay(windowed)(tokens, "linear")) > 1e-4
    r = CliRunner().invoke(main, ["--model", str(out), "--window", "8", "--max-new-tokens", "2", "Hi"])
    assert r.exit_code == 0, r.output
    again = interrupted_then_resumed(small_model_dir, corpus, tmp_path / "resumed", decay=True, decay_lr=0.5)
    assert set(again) == set(maps) and all(torch.equal(again[k], maps[k]) for k in maps)
    # --init from a decayed output keeps (and trains) its decay without --decay
    more = tmp_path / "more"
    linearize(args(small_model_dir, corpus, more, init=str(out), finetune_steps=1, finetune_lr=0.0, decay_lr=1e-9),
              log=lambda m: None)
    assert torch.equal(load_file(more / "maps.safetensors")["feature_map.decay"], maps["feature_map.decay"])
    win = tmp_path / "window"    # a window run trains its decay too (from the fresh -8 here)
    linearize(args(small_model_dir, corpus, win, decay=True, decay_lr=0.5, window=8), log=lambda m: None)
    assert (load_file(win / "maps.safetensors")["feature_map.decay"].float() - -8.0).abs().max() > 0.5
    assert load_model(win)[0].config.window == 8
    assert json.loads((out / "linearize.json").read_text())["args"]["decay"] is True


def test_linearize_gate_learns_writes_and_loads(small_model_dir, corpus, tmp_path):  # noqa: F811
    """--gate: the finetune moves the gate off zero (at --gate-lr) beside the decay, the maps file holds
    both, the output loads gated, --init from it keeps (and trains) the gate without --gate, also across
    an interrupt and --resume, and with a window."""
    out = tmp_path / "gated"
    linearize(args(small_model_dir, corpus, out, gate=True, gate_lr=0.05, decay_lr=0.5), log=lambda m: None)
    maps = load_file(out / "maps.safetensors")
    cfg = load_model(small_model_dir)[0].config
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    assert maps["feature_map.gate"].shape == (L, Hkv, D, 2 * D)
    assert maps["feature_map.gate"].float().abs().max() > 0.05       # moved from the fresh zero
    assert (maps["feature_map.decay"].float() - -8.0).abs().max() > 0.5
    model, _ = load_model(out)
    assert model.hedgehog.has_gate and torch.equal(model.hedgehog.gate_weight, maps["feature_map.gate"].float())
    # a run that takes its gate from --init (no --gate), interrupted and resumed = the same run straight
    straight = tmp_path / "straight"
    linearize(args(small_model_dir, corpus, straight, init=str(out), gate_lr=0.05), log=lambda m: None)
    got = interrupted_then_resumed(small_model_dir, corpus, tmp_path / "resumed", init=str(out), gate_lr=0.05)
    want = load_file(straight / "maps.safetensors")
    assert not torch.equal(want["feature_map.gate"], maps["feature_map.gate"])     # trained further
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    more = tmp_path / "more"
    linearize(args(small_model_dir, corpus, more, init=str(out), finetune_steps=1, finetune_lr=0.0, decay_lr=1e-9,
                   gate_lr=1e-9), log=lambda m: None)
    assert torch.equal(load_file(more / "maps.safetensors")["feature_map.gate"], maps["feature_map.gate"])
    win = tmp_path / "window"
    linearize(args(small_model_dir, corpus, win, init=str(out), window=8, finetune_steps=2, gate_lr=0.05),
              log=lambda m: None)
    assert not torch.equal(load_file(win / "maps.safetensors")["feature_map.gate"], maps["feature_map.gate"])
    assert json.loads((out / "linearize.json").read_text())["args"]["gate"] is True


@GATED
def test_gpu_block_length_keeps_the_decay_exact(monkeypatch, gated):
    """On a GPU the stateless forms run blocks of GPU_CHUNK; with a decay the linear parts are computed
    for every 64-token chunk at once (`decayed_parts`, its scan across chunks) whatever the block, so
    both forms equal their naive twins with either block length (T spans several chunks, unaligned; fp32
    rounding of factors up to e^32: 3e-5 on outputs of ~2)."""
    from engine.attention import linear as lin
    from engine.attention import window as win
    fm = decay_model(num_key_value_heads=2, gated=gated).hedgehog
    T, W = lin.GPU_CHUNK + 77, 37
    q, k, v, valid = window_inputs(T, 6)
    # the naive twins take no block length (and hold T x T x F weights: most of this test's time): once
    want_win = win.window_linear_reference(q, k, v, fm, W, valid, layer=0)
    want_lin = lin.linear_attention_reference(q, k, v, fm, valid, 0)[0]
    for chunk in (CHUNK, lin.GPU_CHUNK):
        monkeypatch.setattr(win, "stateless_chunk", lambda x, c=chunk: c)
        monkeypatch.setattr(lin, "stateless_chunk", lambda x, c=chunk: c)
        for got, want in ((win.window_attention(q, k, v, fm, W, valid, layer=0), want_win),
                          (lin.linear_attention(q, k, v, fm, valid, 0), want_lin)):
            assert max_diff(got[0], want[0]) <= 3e-5 and max_diff(got[1][:, valid[1]], want[1][:, valid[1]]) <= 3e-5
