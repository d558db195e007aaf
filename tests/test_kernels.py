"""engine.kernels: the Triton decode kernels held to their torch forms.

On CPU they run under Triton's interpreter. Triton fixes at its first import whether its own library
is interpreted, so those tests run in one subprocess started with TRITON_INTERPRET=1
(`test_kernels_under_the_interpreter` runs this file there; in this process they skip): nothing
in this process, and no other test, sees the flag. On CUDA the compiled kernels run at realistic
shapes (skipped without a GPU). Every kernel test first checks that the kernel, not the torch form,
runs.
"""
import importlib.util
import inspect
import os
import subprocess
import sys

import pytest
import torch

from engine.attention.feature_maps import Elu1, Hedgehog
from engine.errors import InvalidArgumentError
from engine.attention import linear as attention_linear
from engine.attention.linear import LinearState, hedgehog_layer
from engine.attention.softmax import one_query_attention
from engine.kernels import (backend, linear_attention_step, linear_decode, linear_decode_elu1, linear_decode_hedgehog,
                            softmax_decode, why_not_hedgehog)
from engine.kernels import linear as linear_mod
from engine.kernels import softmax as softmax_mod
from tests.conftest import ROOT, tiny_config

# (not imported here: every xdist worker collects this file)
TRITON = None if importlib.util.find_spec("triton") else "triton is not installed (the test extra installs it on Linux x86_64)"
INTERPRETED = backend.interpreting()    # this process was started with TRITON_INTERPRET=1
CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(TRITON is not None, reason=f"the Triton kernels: {TRITON}")
interpreted = pytest.mark.skipif(
    TRITON is not None or not INTERPRETED,
    reason=f"the Triton kernels: {TRITON}" if TRITON else
    "runs in the TRITON_INTERPRET=1 subprocess of test_kernels_under_the_interpreter")
needs_cuda = pytest.mark.skipif(not CUDA or TRITON is not None or INTERPRETED,
                                reason="compiled Triton kernels need a CUDA GPU" if not CUDA else
                                f"the Triton kernels: {TRITON}" if TRITON else "interpreted run")


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_kernels_under_the_interpreter():
    """This file's tests with triton imported under TRITON_INTERPRET=1, in a fresh process; which first
    checks that importing the engine imports no triton (it is imported on first use only)."""
    code = ("import sys, pytest, engine.api, engine.attention, engine.kernels\n"
            "assert 'triton' not in sys.modules, 'importing the engine imported triton'\n"
            f"sys.exit(pytest.main(['-q', '-n', '0', '-p', 'no:cacheprovider', '-rs', {__file__!r}]))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    print(run.stdout[-6000:], run.stderr[-3000:])
    assert run.returncode == 0
    assert " passed" in run.stdout and "failed" not in run.stdout


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
@pytest.mark.parametrize("kernel", ["linear-elu1", "linear-hedgehog-gated", "linear-hedgehog", "softmax-bf16",
                                    "softmax-fp32", "softmax-combine"])
def test_kernels_compile_for_hopper(kernel):
    """The compiled path, which the interpreter does not take (tl.dot on bfloat16 tensor cores, the
    constexpr branches), compiles for sm_90 on any machine: Triton ships its own ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn, types, constexprs = {
        "linear-elu1": (("linear_triton", "linear_decode_kernel"), {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16"},
                        dict(F=64, ELU1=True, HAS_DECAY=True, GB=4, BLOCK_F=32, BLOCK_DV=64)),
        "linear-hedgehog-gated": (("linear_triton", "hedgehog_decode_kernel"),
                                  {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16"},
                                  dict(D=64, HAS_DECAY=True, HAS_GATE=True, GB=4, BLOCK_F=32, BLOCK_D=64)),
        "linear-hedgehog": (("linear_triton", "hedgehog_decode_kernel"), {"qw_ptr": "*bf16", "kw_ptr": "*fp16"},
                            dict(D=128, HAS_DECAY=False, HAS_GATE=False, GB=2, BLOCK_F=32, BLOCK_D=128)),
        "softmax-bf16": (("softmax_triton", "softmax_split_kernel"), {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "n_ptr": "*i64",
                                                "real_ptr": "*u8"},
                         dict(HAS_N=True, HAS_REAL=True, SCALE_PTR=True, FP32_DOT=False, INTERPRET=False,
                              KEYS_PER_SPLIT=512, GB=16, BLOCK_N=64, BLOCK_D=64)),
        "softmax-fp32": (("softmax_triton", "softmax_split_kernel"), {},
                         dict(HAS_N=False, HAS_REAL=False, SCALE_PTR=False, FP32_DOT=True, INTERPRET=False,
                              KEYS_PER_SPLIT=64, GB=16, BLOCK_N=64, BLOCK_D=16)),
        "softmax-combine": (("softmax_triton", "softmax_combine_kernel"), {"out_ptr": "*bf16"}, dict(BLOCK_S=64, BLOCK_D=64)),
    }[kernel]
    jitted = backend.kernel(*fn)
    names = list(inspect.signature(jitted.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n.endswith("_ptr") else
                 "fp32" if n in ("eps", "scale", "gate_eps") else "i32") for n in names}
    src = ASTSource(fn=jitted, signature=signature,
                    constexprs={(names.index(c),): v for c, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]


def max_diff(a, b):
    d = (a.double() - b.double()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def close(a, b, tol):
    """|a - b| <= tol relative to b's size (1 at least)."""
    return max_diff(a, b) <= tol * max(1.0, b.abs().max().item())


# ---------------------------------------------------------------------------------------- linear

FP32, BF16 = torch.float32, torch.bfloat16

def linear_inputs(B, Hkv, G, F, Dv, decay, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(B, Hkv, G, 1, F, generator=g)
    phi_k = torch.rand(B, Hkv, 1, F, generator=g)
    v = torch.randn(B, Hkv, 1, Dv, generator=g)
    S = torch.randn(B, Hkv, F, Dv, generator=g)
    z = torch.rand(B, Hkv, F, generator=g) * F
    d = {None: None, "shared": torch.rand(Hkv, F, generator=g) * 0.6 + 0.4,
         "gated": torch.rand(B, Hkv, F, generator=g) * 0.6 + 0.4}[decay]
    return [None if t is None else t.to(device) for t in (phi_q, phi_k, v, S, z, d)]


def check_linear_steps(phi_q, phi_k, v, S, z, d, steps=3, tol=1e-5):
    """`steps` kernel steps == as many torch steps: the outputs, S and z."""
    assert linear_mod.why_not(phi_q, S, z, v) is None
    S_r, z_r = S.clone(), z.clone()
    for _ in range(steps):
        out = linear_decode(phi_q, phi_k, v, S, z, d)
        ref = linear_attention_step(phi_q, phi_k, v, S_r, z_r, d)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert close(out, ref, tol)
    assert close(S, S_r, tol) and close(z, z_r, tol)


@interpreted
@pytest.mark.parametrize("G, decay", [(1, None), (3, None), (3, "shared"), (1, "gated"), (3, "gated")])
def test_linear_decode_matches_the_torch_step(G, decay):
    """F and Dv not powers of two (48, 80): the kernel masks its blocks."""
    check_linear_steps(*linear_inputs(2, 2, G, 48, 80, decay), steps=2)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_decode_elu1_applies_the_map_in_the_kernel(dtype):
    B, Hkv, G, D = 2, 2, 2, 24
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(B, Hkv * G, 1, D, generator=g) * 3).to(dtype)   # * 3: both sides of elu's kink
    k = (torch.randn(B, Hkv, 1, D, generator=g) * 3).to(dtype)
    v = torch.randn(B, Hkv, 1, D, generator=g).to(dtype)
    S, z = torch.randn(B, Hkv, D, D, generator=g), torch.rand(B, Hkv, D, generator=g) * D
    S_r, z_r = S.clone(), z.clone()
    assert linear_mod.why_not(q, S, z, v) is None
    out = linear_decode_elu1(q, k, v, S, z)
    fm = Elu1()
    ref = linear_attention_step(fm(q).view(B, Hkv, G, 1, D), fm(k), v.float(), S_r, z_r).view(B, Hkv * G, 1, D)
    assert out.dtype == dtype
    assert close(out, ref.to(dtype), 1e-5 if dtype == torch.float32 else 1e-2)
    assert close(S, S_r, 1e-5) and close(z, z_r, 1e-5)


def test_elu1_fallback_is_the_maps_arithmetic():
    x = torch.randn(1000) * 30
    assert torch.equal(linear_mod.elu1(x), Elu1()(x))


def hedgehog_maps(H, Hkv, D, parts, seed=0, scale=0.5, layers=2):
    """Random hedgehog maps; parts: "" (the map alone), "decay" or "gated" (a decay with a gate)."""
    cfg = tiny_config(num_attention_heads=H, num_key_value_heads=Hkv, hidden_size=H * D, num_hidden_layers=layers)
    fm = Hedgehog.for_config(cfg)
    if parts == "gated":
        fm.add_gate()
    elif parts == "decay":
        fm.add_decay()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in fm.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return cfg, fm


def hedgehog_state(B, H, Hkv, D, parts, seed=0):
    cfg, fm = hedgehog_maps(H, Hkv, D, parts, seed)
    return LinearState.allocate(cfg, B, None, "cpu", torch.float32, feature_map=fm)


def no_torch_featurization(monkeypatch):
    """LinearState's fused decode may not take its torch-featurized route (featurize, then linear_decode)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the map ran in torch: the fused map was not chosen")
    monkeypatch.setattr(attention_linear, "linear_decode", refuse)


@interpreted
@pytest.mark.parametrize("fmap, dtype", [("elu1", FP32), ("hedgehog", FP32), ("hedgehog-decay", FP32),
                                         ("hedgehog-gated", FP32), ("hedgehog-gated", BF16)],
                         ids=["elu1", "hedgehog", "hedgehog-decay", "hedgehog-gated", "hedgehog-gated-bf16"])
@torch.no_grad()
def test_state_fused_decode_matches_its_torch_step(monkeypatch, fmap, dtype):
    """LinearState's decode step through the kernels (what it runs on CUDA) == its torch step, S and z
    included: elu1 and the learned maps applied inside the kernel (chosen by the state: the torch
    featurization is refused here), their decay (gated: per row) too. bf16 q, k, v: the state's own
    torch step widens them as the kernel does."""
    B, H, Hkv, D = 2, 4, 2, 16
    if fmap == "elu1":
        cfg = tiny_config(num_attention_heads=H, num_key_value_heads=Hkv, hidden_size=H * D)
        state = LinearState.allocate(cfg, B, None, "cpu", torch.float32, feature_map="elu1")
    else:
        state = hedgehog_state(B, H, Hkv, D, fmap.removeprefix("hedgehog").removeprefix("-"))
    no_torch_featurization(monkeypatch)
    g = torch.Generator().manual_seed(2)
    state.S.copy_(torch.randn(state.S.shape, generator=g))
    state.z.copy_(torch.rand(state.z.shape, generator=g) * 8)
    ref = LinearState(lengths=state.lengths.clone(), slots=0, S=state.S.clone(), z=state.z.clone(),
                      feature_map=state.feature_map)
    for _ in range(2):
        q, k, v = [(torch.randn(B, n, 1, D, generator=g) * 2).to(dtype) for n in (H, Hkv, Hkv)]
        assert state.map_in_kernel_why_not(1, q, k, v) is None
        span = ref.open(torch.zeros(B, 1, dtype=torch.long))
        want = ref.attend(1, q, k, v, span)
        ref.commit(span)
        S, z = state._layers[1]
        got = state._fused_decode(1, q, k, v, S, z)
        assert got.shape == want.shape and got.dtype == want.dtype == dtype
        assert close(got, want, 1e-5 if dtype == torch.float32 else 1e-2)
    assert close(state.S, ref.S, 1e-5) and close(state.z, ref.z, 1e-5)


def hedgehog_reference_step(fm, layer, q, k, v, S, z):
    """The torch step of LinearState with map fm: featurize in fp32, decay from fm.decay, linear_attention_step."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    phi_k = fm(k, layer, "k")
    phi_q = fm(q, layer, "q").view(B, Hkv, H // Hkv, 1, 2 * D)
    v32 = v.to(phi_k.dtype)
    ld = fm.decay(layer, v32)
    decay = None if ld is None else (ld if ld.dim() == 2 else ld[:, :, 0]).exp()
    return linear_attention_step(phi_q, phi_k, v32, S, z, decay).view(B, H, 1, -1)


SMOLLM2, ODD = (1, 9, 3, 64), (3, 6, 2, 24)


@interpreted
@pytest.mark.parametrize("shape, dtype, parts", [
    (SMOLLM2, FP32, ""), (SMOLLM2, FP32, "decay"), (SMOLLM2, FP32, "gated"), (SMOLLM2, BF16, "gated"),
    (ODD, FP32, "gated"), (ODD, BF16, "")],
    ids=["smollm2-fp32-map", "smollm2-fp32-decay", "smollm2-fp32-gated", "smollm2-bf16-gated", "odd-fp32-gated",
         "odd-bf16-map"])
@torch.no_grad()
def test_hedgehog_decode_applies_the_map_in_the_kernel(shape, dtype, parts):
    """`linear_decode_hedgehog` from the raw q, k, v == the Hedgehog map's own featurization, decay and
    gate + the torch step, two steps, S and z included. SmolLM2's attention (9 query heads on 3 kv heads
    of 64, G 3 padded to a block of 4) on B 1, and D 24 (not a power of two: the column blocks and the
    head's Dv are masked) with G 3 on B 3 (the batch's strides: a program a row, ~2 s a row interpreted
    at SmolLM2's shape). q and k scaled up: softmaxes far from uniform. Layer 1 of 2,
    maps of a strided layout (slices of the stacked parameters). bf16 at SmolLM2's shape only gated (a
    decay and its gate: the map alone and the decay are its parts, and bf16 costs ~4 s a case interpreted)."""
    B, H, Hkv, D = shape
    cfg, fm = hedgehog_maps(H, Hkv, D, parts, scale=0.3)
    g = torch.Generator().manual_seed(7)
    S = torch.randn(B, Hkv, 2 * D, D, generator=g)
    z = torch.rand(B, Hkv, 2 * D, generator=g) * 8
    S_r, z_r = S.clone(), z.clone()
    maps = hedgehog_layer(fm, 1)
    for _ in range(2):
        q, k, v = [(torch.randn(B, n, 1, D, generator=g) * 2).to(dtype) for n in (H, Hkv, Hkv)]
        assert why_not_hedgehog(q, k, v, S, z, maps) is None
        out = linear_decode_hedgehog(q, k, v, S, z, maps)
        ref = hedgehog_reference_step(fm, 1, q, k, v, S_r, z_r)
        assert out.shape == (B, H, 1, D) and out.dtype == dtype
        assert close(out, ref.to(dtype), 1e-5 if dtype == torch.float32 else 1e-2)
    assert close(S, S_r, 1e-5) and close(z, z_r, 1e-5)


@interpreted
def test_hedgehog_in_kernel_refusals_name_their_reason():
    """What the kernel does not read falls back to the torch map, with the reason: fp64 maps, maps on
    another device than the query, maps of another head count, an fp64 state (the fused step's own)."""
    B, H, Hkv, D = 1, 4, 2, 8
    cfg, fm = hedgehog_maps(H, Hkv, D, "gated")
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D)
    S, z = torch.zeros(B, Hkv, 2 * D, D), torch.zeros(B, Hkv, 2 * D)
    maps = hedgehog_layer(fm, 0)
    assert why_not_hedgehog(q, k, v, S, z, maps) is None
    assert "float64 hedgehog maps" in why_not_hedgehog(q, k, v, S, z, maps._replace(q_weight=maps.q_weight.double()))
    assert "q_weight (2, 8, 8)" in why_not_hedgehog(q, k, v, S, z, maps._replace(q_weight=maps.q_weight[:2]))
    assert "the hedgehog maps are on meta" in why_not_hedgehog(q, k, v, S, z, maps._replace(k_bias=maps.k_bias.to("meta")))
    assert "float64" in why_not_hedgehog(q, k, v, S.double(), z.double(), maps)
    state = LinearState.allocate(cfg, B, None, "cpu", torch.float32, feature_map="relu")
    assert "relu map has no in-kernel form" in state.map_in_kernel_why_not(0, q, k, v)


def test_map_in_kernel_falls_back_on_cpu(monkeypatch):
    """Off CUDA (and without the interpreter) the state says why the map is not in the kernel; a layer the
    maps lack raises the map's own error, on either route."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    state = hedgehog_state(1, 4, 2, 8, "gated")
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    assert "CUDA" in state.map_in_kernel_why_not(0, q, k, v)
    with pytest.raises(InvalidArgumentError, match="learned per layer"):
        hedgehog_layer(state.feature_map, 2)


def test_linear_decode_falls_back_to_the_torch_step_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    phi_q, phi_k, v, S, z, d = linear_inputs(2, 2, 2, 8, 8, "shared")
    assert "CUDA" in linear_mod.why_not(phi_q, S, z, v)
    S_r, z_r = S.clone(), z.clone()
    assert torch.equal(linear_decode(phi_q, phi_k, v, S, z, d), linear_attention_step(phi_q, phi_k, v, S_r, z_r, d))
    assert torch.equal(S, S_r)


def test_fp64_state_runs_the_torch_step(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # (the dtype decides before triton is asked)
    phi_q, phi_k, v, S, z, _ = [t.double() for t in linear_inputs(1, 1, 1, 4, 4, None)[:5]] + [None]
    assert "float64" in linear_mod.why_not(phi_q, S, z, v)


# --------------------------------------------------------------------------------------- softmax

def softmax_reference(q, k, v, n_keys, key_real, scale):
    """fp64 masked softmax; a row with no key: 0."""
    B, H, _, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = H // Hkv
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * float(scale)                       # (B, H, 1, N)
    keep = torch.ones(B, N, dtype=torch.bool) if n_keys is None else torch.arange(N) < n_keys.cpu()[:, None]
    keep = keep if key_real is None else keep & key_real.cpu()
    s = s.masked_fill(~keep.to(s.device)[:, None, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vv


def cache_views(B, Hkv, N, D, dtype, seed=0, device="cpu", spare=3):
    """K/V as views of a bigger (layers, B, Hkv, slots, D) cache: strided, as KVState hands them out."""
    g = torch.Generator().manual_seed(seed)
    big_k = torch.randn(2, B, Hkv, N + spare, D, generator=g).to(dtype).to(device)
    big_v = torch.randn(2, B, Hkv, N + spare, D, generator=g).to(dtype).to(device)
    return big_k[1, :, :, :N], big_v[1, :, :, :N]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("G, splits", [(1, "one"), (3, "several")])
def test_softmax_decode_matches_a_masked_reference(monkeypatch, dtype, G, splits):
    """Lengths per row (one whole, one short, one of a single key, one empty), pad keys, N = 150 not a
    multiple of the 64-key tile, D = 24 not a power of two, strided cache views, a 0-dim tensor scale."""
    if splits == "several":   # 3 splits of 64 keys: the short rows leave whole splits empty
        monkeypatch.setattr(softmax_mod, "MIN_KEYS_PER_SPLIT", 32)
        monkeypatch.setattr(softmax_mod, "_programs_wanted", lambda device: 64)
    B, Hkv, N, D = 4, 2, 150, 24
    k, v = cache_views(B, Hkv, N, D, dtype)
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(B, Hkv * G, 1, D, generator=g) * 2).to(dtype)
    n_keys = torch.tensor([150, 70, 1, 0])
    key_real = torch.rand(B, N, generator=g) > 0.3
    key_real[2, 0] = True
    scale = torch.tensor(D ** -0.5)
    assert softmax_mod.why_not(q, k, v) is None
    assert softmax_mod.splits_for(N, B * Hkv, q.device)[0] == (3 if splits == "several" else 1)
    out = softmax_decode(q, k, v, n_keys, key_real, scale)
    ref = softmax_reference(q, k, v, n_keys, key_real, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert max_diff(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert out[3].abs().max() == 0                                                 # no key: 0
    # the torch form rounds the scores and the weights to bf16 (as one_query_attention does): looser
    assert max_diff(softmax_mod.softmax_decode_torch(q, k, v, n_keys, key_real, scale), ref) \
        <= (1e-5 if dtype == torch.float32 else 3e-2)


@interpreted
def test_softmax_decode_without_lengths_or_pads_equals_one_query_attention():
    """n_keys None and key_real None: every key of every row, as KVState's unpadded decode reads them;
    a float scale; the cache in bf16 under an fp32 query (a 16-bit kv_dtype) read as it is."""
    B, Hkv, G, N, D = 2, 2, 2, 90, 16
    k, v = cache_views(B, Hkv, N, D, torch.bfloat16)
    q = torch.randn(B, Hkv * G, 1, D, generator=torch.Generator().manual_seed(3))
    out = softmax_decode(q, k, v, None, None, D ** -0.5)
    ref = one_query_attention(q, k.float(), v.float(), torch.tensor(D ** -0.5))
    assert out.dtype == torch.float32
    assert max_diff(out, ref) <= 1e-5


def test_softmax_decode_falls_back_to_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    B, Hkv, N, D = 2, 2, 40, 8
    k, v = cache_views(B, Hkv, N, D, torch.float32)
    q = torch.randn(B, 4, 1, D)
    n_keys, key_real = torch.tensor([40, 9]), torch.rand(B, N) > 0.2
    assert "CUDA" in softmax_mod.why_not(q, k, v)
    assert max_diff(softmax_decode(q, k, v, n_keys, key_real, D ** -0.5),
                    softmax_reference(q, k, v, n_keys, key_real, D ** -0.5)) <= 1e-5


# ------------------------------------------------------------------------------ CUDA, compiled

@needs_cuda
@pytest.mark.parametrize("B", [1, 32])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog-gated"])
def test_cuda_linear_decode_llama_1b_shape(B, fmap):
    """Llama-3.2-1B's attention (32 query heads, 8 kv heads, head 64): elu1 (F 64) and hedgehog (F 128)
    with a gated decay, ten steps, fp32 state."""
    Hkv, G, D = 8, 4, 64
    F = D if fmap == "elu1" else 2 * D
    phi_q, phi_k, v, S, z, d = linear_inputs(B, Hkv, G, F, D, None if fmap == "elu1" else "gated", device="cuda")
    check_linear_steps(phi_q, phi_k, v, S, z, d, steps=10)


@needs_cuda
@pytest.mark.parametrize("B", [1, 32])
def test_cuda_linear_decode_elu1_bf16(B):
    Hkv, G, D = 8, 4, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hkv * G, 1, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, Hkv, 1, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, Hkv, 1, D, device="cuda", generator=g).bfloat16()
    S = torch.randn(B, Hkv, D, D, device="cuda", generator=g)
    z = torch.rand(B, Hkv, D, device="cuda", generator=g) * D
    S_r, z_r = S.clone(), z.clone()
    out = linear_decode_elu1(q, k, v, S, z)
    fm = Elu1()
    ref = linear_attention_step(fm(q).view(B, Hkv, G, 1, D), fm(k), v.float(), S_r, z_r).view(B, Hkv * G, 1, D)
    assert close(out, ref.bfloat16(), 1e-2)
    assert close(S, S_r, 1e-5) and close(z, z_r, 1e-5)


@needs_cuda
@pytest.mark.parametrize("B", [1, 32])
@pytest.mark.parametrize("parts", ["", "gated"], ids=["map", "gated"])
@torch.no_grad()
def test_cuda_hedgehog_decode_llama_1b_shape(B, parts):
    """The hedgehog map in the kernel, compiled, at Llama-3.2-1B's attention (32 on 8 heads of 64): bf16
    q, k, v, fp32 maps (as linearized ones load), ten steps against the map + torch step, S and z included."""
    H, Hkv, D = 32, 8, 64
    cfg, fm = hedgehog_maps(H, Hkv, D, parts, scale=0.1)
    fm = fm.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    S = torch.randn(B, Hkv, 2 * D, D, device="cuda", generator=g)
    z = torch.rand(B, Hkv, 2 * D, device="cuda", generator=g) * 8
    S_r, z_r = S.clone(), z.clone()
    maps = hedgehog_layer(fm, 1)
    for _ in range(10):
        q, k, v = [torch.randn(B, n, 1, D, device="cuda", generator=g).bfloat16() for n in (H, Hkv, Hkv)]
        assert why_not_hedgehog(q, k, v, S, z, maps) is None
        out = linear_decode_hedgehog(q, k, v, S, z, maps)
        ref = hedgehog_reference_step(fm, 1, q, k, v, S_r, z_r)
        assert close(out, ref.bfloat16(), 1e-2)
    assert close(S, S_r, 1e-4) and close(z, z_r, 1e-4)


@needs_cuda
@pytest.mark.parametrize("B", [1, 32])
def test_cuda_softmax_decode_32k_bf16(B):
    """Hkv 8, G 4, D 64, a 32k-slot bf16 cache; rows of different lengths (the full cache among them),
    pad keys; against the fp32 torch form and SDPA over each row's real keys."""
    Hkv, G, N, D = 8, 4, 32768, 64
    k, v = cache_views(B, Hkv, N, D, torch.bfloat16, device="cuda", spare=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = (torch.randn(B, Hkv * G, 1, D, device="cuda", generator=g) * 2).bfloat16()
    n_keys = torch.randint(1, N + 1, (B,), device="cuda", generator=g)
    n_keys[0] = N
    key_real = torch.rand(B, N, device="cuda", generator=g) > 0.1
    key_real[:, 0] = True
    scale = torch.tensor(D ** -0.5, device="cuda")
    assert softmax_mod.why_not(q, k, v) is None
    out = softmax_decode(q, k, v, n_keys, key_real, scale)
    ref = softmax_mod.softmax_decode_torch(q.float(), k.float(), v.float(), n_keys, key_real, scale)
    assert out.dtype == torch.bfloat16
    assert max_diff(out, ref) <= 2e-2 * max(1.0, ref.abs().max().item())
    for b in (0, B - 1):   # one row through SDPA, over its real keys only
        keep = key_real[b, :int(n_keys[b])].nonzero()[:, 0]
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], enable_gqa=True)
        assert max_diff(out[b:b + 1], sdpa) <= 2e-2 * max(1.0, sdpa.abs().max().item())


@needs_cuda
def test_cuda_softmax_decode_replays_in_a_cuda_graph():
    """Captured once, replayed with other lengths written into the same n_keys tensor: the same
    numbers as eager calls (no host sync inside, the lengths read on the device)."""
    B, Hkv, G, N, D = 4, 8, 4, 4096, 64
    k, v = cache_views(B, Hkv, N, D, torch.bfloat16, device="cuda", spare=0)
    q = torch.randn(B, Hkv * G, 1, D, device="cuda").bfloat16()
    n_keys = torch.full((B,), 100, device="cuda", dtype=torch.long)
    scale = torch.tensor(D ** -0.5, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm up (compile) off the capture
        softmax_decode(q, k, v, n_keys, None, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = softmax_decode(q, k, v, n_keys, None, scale)
    for lengths in ([100, 1, 4096, 2000], [4096, 4096, 7, 3000]):
        n_keys.copy_(torch.tensor(lengths))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, softmax_decode(q, k, v, n_keys, None, scale))


@needs_cuda
@pytest.mark.parametrize("path", ["softmax", "linear-elu1", "linear-hedgehog-gated"])
def test_cuda_model_decode_through_the_kernels_equals_cpu(path):
    """A tiny fp32 model: prefill then ten steps (forced tokens) on CUDA (the kernels) == on the CPU (torch)."""
    from tests.conftest import tiny_model
    from tests.test_decay import decay_model
    if path == "linear-hedgehog-gated":
        model, attention, fmap = decay_model(gated=True, num_key_value_heads=2), "linear", None
    else:
        model = tiny_model(num_key_value_heads=2)
        attention, fmap = ("softmax", None) if path == "softmax" else ("linear", "elu1")
    tokens = torch.randint(0, 97, (3, 22), generator=torch.Generator().manual_seed(0))
    logits = {}
    for device in ("cpu", "cuda"):
        m = model.to(device)
        state = m.init_state(3, 64, attention, feature_map=fmap, device=device)
        if device == "cuda" and attention == "linear":   # the map runs inside the kernel (elu1, hedgehog)
            cfg = m.config
            q = torch.zeros(3, cfg.num_attention_heads, 1, cfg.head_dim, device=device)
            k = torch.zeros(3, cfg.num_key_value_heads, 1, cfg.head_dim, device=device)
            assert state.map_in_kernel_why_not(0, q, k, k) is None
        t = tokens.to(device)
        with torch.no_grad():
            out = [m.step(t[:, :12], state, last_only=True)]
            out += [m.step(t[:, i:i + 1], state) for i in range(12, 22)]
        logits[device] = torch.cat(out, 1).cpu()
    assert max_diff(logits["cuda"], logits["cpu"]) <= 1e-4


# ------------------------------------------------------------------------------ the benchmark

def benchmark_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "benchmarks" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(CUDA, reason="this machine has CUDA: the benchmark would run")
def test_gpu_benchmark_says_it_needs_cuda(capsys):
    bench = benchmark_module()
    assert bench.parse(["--shapes", "1x1024,32x8192"]).shapes == [(1, 1024), (32, 8192)]
    with pytest.raises(SystemExit) as e:
        bench.parse(["--shapes", "1x"])
    assert e.value.code == 2 and "BATCHxDEPTH" in capsys.readouterr().err
    assert bench.main(["--json", str(ROOT / "never-written.json")]) == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert not (ROOT / "never-written.json").exists()
