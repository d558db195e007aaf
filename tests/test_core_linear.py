"""Linear path: recurrence == chunked prefill == naive masked quadratic form, state included."""
import pytest
import torch

from engine.attention.feature_maps import FEATURE_MAPS, get_feature_map
from engine.attention.linear import (CHUNK, LinearState, featurize, linear_attention_chunked,
                                     linear_attention_reference, linear_attention_step)
from engine.errors import InvalidArgumentError
from engine.steps import make_step
from tests.conftest import tiny_model

FMAPS = [n for n in FEATURE_MAPS if n not in ("hedgehog", "zero")]   # the learned map: tests/test_hedgehog.py;
# zero (no linear branch): tests/test_window.py


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def qkv(B=2, H=4, Hkv=2, T=70, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, Hkv, T, D, generator=g).to(dtype),
            torch.randn(B, Hkv, T, D, generator=g).to(dtype))


@pytest.mark.parametrize("fmap", FMAPS)
@pytest.mark.parametrize("T", [1, 17, CHUNK, CHUNK + 6, 3 * CHUNK], ids=lambda t: f"T{t}")
def test_recurrence_equals_chunked_equals_naive(fmap, T):
    q, k, v = qkv(T=T)
    fm = get_feature_map(fmap)
    ref_out, ref_S, ref_z = linear_attention_reference(q, k, v, fm)
    phi_q, phi_k, v32 = featurize(fm, q, k, v)
    out_c, S_c, z_c = linear_attention_chunked(phi_q, phi_k, v32)
    S = torch.zeros_like(S_c)
    z = torch.zeros_like(z_c)
    out_r = torch.cat([linear_attention_step(phi_q[:, :, :, t:t + 1], phi_k[:, :, t:t + 1], v32[:, :, t:t + 1], S, z)
                       for t in range(T)], dim=3)
    assert max_diff(out_c.flatten(1, 2), ref_out) <= 1e-5
    assert max_diff(out_r.flatten(1, 2), ref_out) <= 1e-5
    for S_, z_ in ((S_c, z_c), (S, z)):
        assert max_diff(S_, ref_S) <= 1e-5 * max(1.0, ref_S.abs().max().item())
        assert max_diff(z_, ref_z) <= 1e-5 * max(1.0, ref_z.abs().max().item())


@pytest.mark.parametrize("fmap", FMAPS)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_model_steps_equal_prefill_equal_naive(fmap, kv_heads):
    model = tiny_model(num_key_value_heads=kv_heads)
    T = 20
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        naive = model(tokens, "linear", feature_map=fmap, reference=True)
        chunked_full = model(tokens, "linear", feature_map=fmap)
    s_pre = model.init_state(2, None, "linear", feature_map=fmap)
    prefill = model.step(tokens, s_pre)
    s_rec = model.init_state(2, None, "linear", feature_map=fmap)
    steps = torch.cat([model.step(tokens[:, t:t + 1], s_rec) for t in range(T)], 1)
    assert max_diff(chunked_full, naive) <= 1e-5
    assert max_diff(prefill, naive) <= 1e-5
    assert max_diff(steps, naive) <= 1e-5
    assert max_diff(s_pre.S, s_rec.S) <= 1e-5 * s_rec.S.abs().max().item()
    assert max_diff(s_pre.z, s_rec.z) <= 1e-5 * s_rec.z.abs().max().item()


@pytest.mark.parametrize("fmap", FMAPS)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_prefill_then_steps_equals_naive_at_every_split(fmap, kv_heads):
    """prefill(t) + one step() per remaining token == the naive form, for every t, across a chunk edge."""
    model = tiny_model(num_hidden_layers=1, num_key_value_heads=kv_heads)
    T = CHUNK + 6
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        naive = model(tokens, "linear", feature_map=fmap, reference=True)
    full = model.init_state(2, None, "linear", feature_map=fmap)
    model.step(tokens, full)
    worst_out = worst_S = worst_z = 0.0
    for t in range(1, T):
        state = model.init_state(2, None, "linear", feature_map=fmap)
        outs = [model.step(tokens[:, :t], state)] + [model.step(tokens[:, i:i + 1], state) for i in range(t, T)]
        worst_out = max(worst_out, (torch.cat(outs, 1) - naive).abs().max().item())
        worst_S = max(worst_S, (state.S - full.S).abs().max().item() / full.S.abs().max().item())
        worst_z = max(worst_z, (state.z - full.z).abs().max().item() / full.z.abs().max().item())
    print(f"max |diff| logits {worst_out:.3e}, relative S {worst_S:.3e}, relative z {worst_z:.3e}")
    assert worst_out <= 1e-5 and worst_S <= 1e-5 and worst_z <= 1e-5


@pytest.mark.parametrize("fmap", FMAPS)
@pytest.mark.parametrize("t1,t2", [(CHUNK, CHUNK), (37, 50), (CHUNK, 45), (1, 2 * CHUNK + 3), (100, 1)],
                         ids=lambda x: str(x))
def test_prefill_then_prefill_equals_one_prefill(fmap, t1, t2):
    model = tiny_model(num_hidden_layers=1)
    tokens = torch.randint(0, 97, (1, t1 + t2), generator=torch.Generator().manual_seed(t1))
    one = model.init_state(1, None, "linear", feature_map=fmap)
    out_one = model.step(tokens, one)
    two = model.init_state(1, None, "linear", feature_map=fmap)
    out_two = torch.cat([model.step(tokens[:, :t1], two), model.step(tokens[:, t1:], two)], 1)
    assert max_diff(out_two, out_one) <= 1e-5
    assert max_diff(two.S, one.S) <= 1e-5 * one.S.abs().max().item()
    assert max_diff(two.z, one.z) <= 1e-5 * one.z.abs().max().item()
    assert two.pos == one.pos == t1 + t2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_state_is_fp32_for_half_models(dtype):
    model = tiny_model(dtype=dtype)
    state = model.init_state(1, None, "linear")
    assert state.S.dtype == torch.float32 and state.z.dtype == torch.float32
    logits = model.step(torch.tensor([[1, 2, 3, 4]]), state)
    model.step(torch.tensor([[5]]), state)
    assert logits.dtype == dtype and state.S.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("fmap", FMAPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adversarial_half_inputs_stay_finite(fmap, dtype):
    """In bf16 elu(x)+1 is exactly 0 for x < -8; maps run in fp32 and the denominator has EPS (PITFALLS #12)."""
    B, H, T, D = 1, 2, 9, 8
    q = torch.full((B, H, T, D), -30.0, dtype=dtype)
    k = torch.full((B, H, T, D), -30.0, dtype=dtype)
    k[..., ::2, :] = 60.0
    v = torch.randn(B, H, T, D).to(dtype)
    fm = get_feature_map(fmap)
    phi = fm(q)
    assert phi.dtype == torch.float32
    if fmap in ("elu1", "softmax"):
        assert (phi > 0).all(), "strictly positive feature map underflowed to 0"
    sim = fm(q) @ fm(k).transpose(-1, -2)
    assert (sim >= 0).all(), "similarity went negative"
    phi_q, phi_k, v32 = featurize(fm, q, k, v)
    out, S, z = linear_attention_chunked(phi_q, phi_k, v32)
    assert (phi_q @ z[:, :, None, :, None] >= 0).all(), "denominator went negative"
    assert torch.isfinite(out).all() and torch.isfinite(S).all()
    # the one-token decode path of a half-precision model, fed the same adversarial q, k
    state = LinearState.allocate(tiny_model().config.replace(num_hidden_layers=1, num_attention_heads=H,
                                                             num_key_value_heads=H, head_dim=D),
                                 B, None, "cpu", dtype, feature_map=fmap)
    span = state.open(torch.zeros(B, 1, dtype=torch.long))
    for t in range(T):
        step_out = state.attend(0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], span)
        assert step_out.dtype == dtype and torch.isfinite(step_out).all(), f"non-finite output at step {t}"
    assert torch.isfinite(state.S).all() and torch.isfinite(state.z).all()


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_long_decode_stays_close_to_fp64(backend):
    """10,000 one-token steps of the fp32 step forms gen runs (PyTorch, and the default: native where
    it builds): finite, and within 1e-3 of the same tokens in fp64 (PITFALLS #13: 10^4+ steps). The
    fp64 side is one chunked prefill (prefill == steps is held at every split elsewhere)."""
    n = 10_000
    shape = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                 num_key_value_heads=2)
    m32, m64 = tiny_model(**shape), tiny_model(**shape).double()
    tokens = torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(0))
    ref = m64.step(tokens, m64.init_state(1, None, "linear"))[0]        # (n, V) fp64
    step, s32 = make_step(m32, backend), m32.init_state(1, None, "linear")
    worst = 0.0
    for t in range(n):
        a = step(tokens[:, t:t + 1], s32)
        if t % 100 == 99 or t == n - 1:
            assert torch.isfinite(a).all(), f"non-finite logits at step {t}"
            worst = max(worst, (a.double().reshape(-1) - ref[t]).abs().max().item())
    print(f"{step.last_form}: max |fp32 - fp64| over {n} steps = {worst:.3e}; z max = {s32.z.max().item():.1f}")
    assert s32.seen.item() == n
    assert worst <= 1e-3


def test_unknown_feature_map_lists_valid_names():
    model = tiny_model()
    with pytest.raises(InvalidArgumentError, match="unknown feature map 'gelu'; valid: elu1, relu, softmax, cos1"):
        model.init_state(1, None, "linear", feature_map="gelu")


@pytest.mark.parametrize("fmap,width", [("elu1", 16), ("relu", 16), ("softmax", 16), ("cos1", 17)])
def test_feature_maps_report_width_and_state_bytes(fmap, width):
    model = tiny_model()
    cfg = model.config
    assert FEATURE_MAPS[fmap].out_dim(cfg.head_dim) == width
    state = model.init_state(2, None, "linear", feature_map=fmap)
    expected = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (width * cfg.head_dim + width) * 4
    assert state.nbytes == expected


def test_cos1_similarity_is_one_plus_cosine():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    fm = get_feature_map("cos1")
    sim = (fm(a) * fm(b)).sum(-1)
    assert max_diff(sim, 1 + torch.cosine_similarity(a, b, dim=-1)) <= 1e-6
