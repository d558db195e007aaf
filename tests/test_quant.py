"""engine.quant: blocks byte-for-byte as llama.cpp's reference quantizers (gguf-py), dequantization as
gguf-py's; the native quantized matmul (qdot.c) against its PyTorch twin `linear_q8`; the native
quantized step against the module path computing the same way, and loosely against dequantize-then-fp32."""
import ctypes

import numpy as np
import pytest
import torch

from engine.errors import InvalidArgumentError
from engine.quant import (BLOCK_BYTES, QuantLinear, QuantLinearQ8, dequantize, linear_q8, q8_reference, quantize,
                          quantize_activations, quantize_model)
from engine.steps import Stepper
from tests.conftest import tiny_model

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}


def weights(seed=0, rows=48, cols=96):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.1
    w[0, :32] = 0.0                      # an all-zero block: d = 0
    w[1, :32] = 0.25                     # a constant block
    w[2, 5] = -3.0                       # an outlier
    return w


@pytest.mark.parametrize("kind", list(QTYPE))
def test_blocks_equal_gguf_reference(kind):
    w = weights()
    ours = quantize(w, kind)
    ref = quants.quantize(w.numpy(), QTYPE[kind])
    assert ours.shape == (48, 96 // 32 * BLOCK_BYTES[kind])
    assert np.array_equal(ours.numpy(), ref), "blocks differ from llama.cpp's reference quantizer"
    back = dequantize(ours, kind, w.shape)
    assert np.array_equal(back.numpy(), quants.dequantize(ref, QTYPE[kind]).astype(np.float32))
    step = (w.reshape(48, 3, 32).abs().amax(-1) * (2 / 127 if kind == "q8_0" else 2 / 15)).max().item()
    assert (back - w).abs().max().item() <= step


def test_quantize_model_keeps_widths_it_cannot_block():
    model = tiny_model(intermediate_size=40)          # down_proj has 40 inputs: not a multiple of 32
    kept = quantize_model(model, "q8_0")
    assert kept == [f"layers.{i}.mlp.down_proj" for i in range(2)]
    with pytest.raises(InvalidArgumentError):
        quantize_model(model, "q5_k")


def test_load_says_which_matrices_stay_in_float(tmp_path):
    """load(quantize=...) on widths blocks cannot take left them float without a word (the rule is 32-wide
    blocks): a QuantizeWarning names how many and which."""
    from engine.api import QuantizeWarning, load
    from models.weights import save_pretrained
    save_pretrained(tiny_model(intermediate_size=40), str(tmp_path))
    with pytest.warns(QuantizeWarning, match=r"quantize=q8_0: 2 of 9 matrices stay in float .*layers\.0\.mlp\.down_proj"):
        load(str(tmp_path), quantize="q8_0", backend="torch")


def test_quantize_model_requantizes_other_kinds_and_keeps_its_own():
    model = tiny_model()
    quantize_model(model, "q4_1")
    blocks = model.layers[0].mlp.gate_up.blocks
    quantize_model(model, "q4_1")
    assert model.layers[0].mlp.gate_up.blocks is blocks           # its own kind: the blocks as they are
    quantize_model(model, "q8_0")
    gu = model.layers[0].mlp.gate_up
    assert isinstance(gu, QuantLinear) and gu.kind == "q8_0"
    assert torch.equal(gu.blocks, quantize(dequantize(blocks, "q4_1", (gu.out_features, gu.in_features)), "q8_0"))


# ------------------------------------------------------------------ the native quantized matmul
@pytest.fixture(scope="module")
def native(native_kernels):
    return native_kernels


def native_matmul(native, blocks, kind, shape, x):
    """x (B, cols) fp32 -> (out (B, rows), q (B, cols) int8 as rounded by qdot.c's quantize_x, d (B, nb))."""
    lib, Mat = native
    rows, cols = shape
    B = x.shape[0]
    rs = lib.qx_row_bytes(cols)
    qx = torch.zeros(B, rs, dtype=torch.uint8)
    out = torch.empty(B, rows)
    m = Mat(blocks.data_ptr(), {"q8_0": 3, "q4_0": 4, "q4_1": 5}[kind], rows, cols)
    lib.gen_qmatmul(ctypes.byref(m), x.contiguous().data_ptr(), B, out.data_ptr(), qx.data_ptr())
    q = qx[:, :cols].view(torch.int8)
    d = qx[:, cols:cols + 8 * (cols // 32)].contiguous().view(torch.float32)[:, 0::2]   # pairs (d, d * sum)
    return out, q, d


@pytest.mark.parametrize("kind", list(QTYPE))
@pytest.mark.parametrize("B", [1, 3, 6])
def test_native_qmatmul_equals_linear_q8(native, kind, B):
    """Given the same x, qdot.c rounds it to exactly linear_q8's integers and scales (byte for byte),
    and its outputs match linear_q8's exact integer dots within fp32 summation order (1e-6 relative)."""
    w = weights(seed=3, rows=40, cols=160)
    blocks = quantize(w, kind)
    g = torch.Generator().manual_seed(B)
    x = torch.randn(B, 160, generator=g) * 2
    x[0, :32] = 0.0                                                   # an all-zero activation block
    x[-1, 40] = 50.0                                                  # an outlier
    got, q, d = native_matmul(native, blocks, kind, w.shape, x)
    q_ref, d_ref = quantize_activations(x)
    assert torch.equal(q.to(torch.int32), q_ref.reshape(B, 160)) and torch.equal(d, d_ref)
    want = linear_q8(x, blocks, kind, w.shape)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    exact = x @ dequantize(blocks, kind, w.shape).T                   # dequantize-then-fp32
    rel_deq = ((got - exact).abs().max() / exact.abs().max()).item()
    print(f"{kind} B{B}: relative to linear_q8 {rel:.1e}, to dequantize-then-fp32 {rel_deq:.1e}")
    assert rel <= 1e-6
    assert rel_deq <= 2e-2          # activation rounding: <= 1/254 of a block's largest |x| per element


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("cols", [128, 160, 288])      # 4 blocks; 1 group + 1 more; 2 groups + 1 more
@pytest.mark.parametrize("B", [1, 3, 6])
def test_native_regrouped_qmatmul_equals_linear_q8(native, kind, cols, B):
    """The grouped kernels (4 blocks per load: q4_1's pairs then nibbles, q8_0's scales then weights
    + 128) give linear_q8's exact integer dots within fp32 summation order, as the per-block kernel."""
    from engine.steps.native import _regrouped
    lib, Mat = native
    lib.gen_has_q4_1r.restype = ctypes.c_int
    if not lib.gen_has_q4_1r():
        pytest.skip("this build has no grouped q4_1 / q8_0 kernels (they need AVX-512 VNNI)")
    w = weights(seed=4, rows=40, cols=cols)
    blocks = quantize(w, kind)
    x = torch.randn(B, cols, generator=torch.Generator().manual_seed(B)) * 2
    x[-1, 40] = 50.0
    grouped = _regrouped(torch.nn.Module(), blocks, 40, kind == "q4_1")
    assert grouped.numel() == blocks.numel() and not torch.equal(grouped.flatten(), blocks.flatten())
    rs = lib.qx_row_bytes(cols)
    got = torch.empty(B, 40)
    m = Mat(grouped.data_ptr(), {"q8_0": 7, "q4_1": 6}[kind], 40, cols)      # gen.h T_Q8_0R, T_Q4_1R
    qx = torch.zeros(B, rs, dtype=torch.uint8)
    lib.gen_qmatmul(ctypes.byref(m), x.contiguous().data_ptr(), B, got.data_ptr(), qx.data_ptr())
    want = linear_q8(x, blocks, kind, w.shape)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{kind} cols {cols} B{B}: grouped relative to linear_q8 {rel:.1e}")
    assert rel <= 1e-6
    one, last = torch.empty(1, 40), x[-1:].contiguous()       # a row's result does not depend on its batch
    lib.gen_qmatmul(ctypes.byref(m), last.data_ptr(), 1, one.data_ptr(), qx.data_ptr())
    assert torch.equal(one[0], got[-1])


# ------------------------------------------------------------------ the native quantized step
def decode(model, step_model, backend, kind_attention, batch=2, follow=16):
    """Prefill on `model` (PyTorch, dequantized weights), then `follow` steps of `step_model` on `backend`."""
    g = torch.Generator().manual_seed(7)
    prompt, ids = torch.randint(0, 97, (batch, 5), generator=g), torch.randint(0, 97, (batch, follow), generator=g)
    state = model.init_state(batch, 64, kind_attention)
    model.step(prompt, state)
    step = Stepper(step_model, backend, threads=2)
    out, forms = [], set()
    for t in ids.T:
        out.append(step(t.reshape(batch, 1), state))
        forms.add(step.last_form)
    return torch.cat(out, 1), forms                                   # (B, follow, V)


@pytest.mark.parametrize("kind", list(QTYPE))
@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_native_quantized_step_equals_its_reference(native, kind, attention):
    """The native step against q8_reference (the module path with activations rounded to q8 blocks
    and integer dots, as qdot.c): 1e-5 on almost every logit vector. Not on all: where torch's and the
    C code's fp32 sums put one activation a rounding ulp apart at a q8 tie (x / d within ~1e-7 of
    k + 1/2), the two round it 1/127 of its block's max apart and the KV cache carries that on, so a
    run may drift by ~1e-2 from that step; the loose bound below (dequantize-then-fp32's) still holds.
    Against dequantize-then-fp32 the activation rounding costs ~1e-2 on logits of scale ~2."""
    model = tiny_model(num_key_value_heads=2, tie_word_embeddings=False)
    assert quantize_model(model, kind) == []
    ref, _ = decode(model, q8_reference(model), "module", attention)
    got, forms = decode(model, model, "native", attention)
    exact, _ = decode(model, model, "module", attention)
    per_step = (got - ref).abs().amax(-1)                             # (B, follow)
    d_exact = (got - exact).abs().max().item()
    tight = (per_step <= 1e-5).float().mean().item()
    print(f"{kind} {attention}: |native - q8 reference| max {per_step.max():.1e}, within 1e-5 on "
          f"{tight:.0%} of steps; |native - dequantize-then-fp32| {d_exact:.1e}")
    assert forms == {"native"}
    assert tight >= 0.75 and per_step.max() <= 0.1
    assert d_exact <= 0.1


def test_q8_reference_is_not_dequantize_then_fp32():
    """The reference twin rounds activations (it would be vacuous if it matched the float path)."""
    model = tiny_model()
    quantize_model(model, "q8_0")
    x = torch.randn(3, model.config.hidden_size)
    lin = model.layers[0].mlp.gate_up
    ref = q8_reference(model).layers[0].mlp.gate_up(x)
    d = (ref - lin(x)).abs().max().item()
    assert 1e-5 < d < 5e-2


def test_load_quantize_generates_greedy_ids_of_its_reference(native, small_model_dir):
    """load(..., quantize=) keeps the matrices as blocks and decodes natively; greedy decoding with the
    native step picks, at every step, the argmax of the q8 reference on a twin state (the same PyTorch
    prefill). Against dequantize-then-fp32 the ids may part at a near-tie of a random model."""
    from engine import load
    llm = load(str(small_model_dir), quantize="q4_0", backend="native")
    assert isinstance(llm.model.layers[0].mlp.gate_up, QuantLinear)
    llm.generate("the cat", max_new_tokens=4, temperature=0, ignore_eos=True)
    assert llm.step.last_form == "native"
    model, ref = llm.model, q8_reference(llm.model)
    prompt = torch.tensor([llm.encode("the cat")])
    state, twin = model.init_state(1, 64), model.init_state(1, 64)
    first = [model.step(prompt, s)[:, -1] for s in (state, twin)][0]
    step = Stepper(model, "native", threads=2)
    got, want, t = [], [], int(first.argmax())
    for _ in range(12):
        got.append(t)
        a, b = step(torch.tensor([[t]]), state)[:, -1], ref.step(torch.tensor([[t]]), twin)[:, -1]
        t = int(a.argmax())
        want.append(int(b.argmax()))
    assert step.last_form == "native"
    assert got[1:] == want[:-1]


def test_dequantize_model_gives_float_matrices_of_the_same_weights():
    from engine.quant import dequantize_model
    model = tiny_model()
    quantize_model(model, "q4_1")
    before = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    epoch = model.weights_epoch
    dequantize_model(model)
    after = dict(model.named_modules())
    assert before and all(type(after[n]) is torch.nn.Linear and torch.equal(after[n].weight, w) for n, w in before.items())
    assert model.weights_epoch > epoch


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_own_blocks_held_grouped_compute_as_stored(kind):
    """QuantLinear.group holds a module's own q4_1 / q8_0 blocks in the native step's grouped layout
    (ungroup_rows gives back the stored bytes exactly) and every PyTorch form computes from it as from
    the stored blocks, bit for bit; blocks that view a checkpoint (own False) are never regrouped."""
    from engine.quant import group_rows, ungroup_rows
    torch.manual_seed(3)
    lin = torch.nn.Linear(160, 24, bias=True)          # 5 blocks a row: a group of 4 and one past it
    stored = QuantLinear.from_linear(lin, kind)
    blocks = stored.blocks.clone()
    assert torch.equal(ungroup_rows(group_rows(blocks, 24, kind), 24, kind), blocks)
    assert not torch.equal(group_rows(blocks, 24, kind), blocks)
    x = torch.randn(3, 160)
    want_w, want_y, want_q8 = stored.weight, stored(x), linear_q8(x, blocks, kind, (24, 160)) + stored.bias
    assert stored.own and stored.group() and stored.grouped
    assert torch.equal(stored.blocks, group_rows(blocks, 24, kind)) and torch.equal(stored.stored_blocks(), blocks)
    assert torch.equal(stored.weight, want_w) and torch.equal(stored(x), want_y)
    twin = QuantLinearQ8(blocks.clone(), kind, 160, 24, bias=stored.bias, own=True)   # q8_reference's form
    assert type(twin).group(twin) is False and torch.equal(twin(x), want_q8)          # a subclass: never grouped
    twin.grouped, twin.blocks = True, group_rows(blocks, 24, kind)                     # were it grouped: the same
    assert torch.equal(twin(x), want_q8)
    view = QuantLinear(blocks, kind, 160, 24)          # as the loader holds a file's blocks
    assert not view.group() and not view.grouped and view.blocks.data_ptr() == blocks.data_ptr()
