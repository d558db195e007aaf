"""GGUF Q5_0 / Q5_1 blocks kept as loaded (issue 33 item 3). llama-quantize stores a matrix whose rows
are no multiple of 256 in a fallback type (Q4_K -> Q5_0, Q5_K -> Q5_1): SmolLM2's Q4_K_M / Q5_K_M
files hold most of their matrices so. engine.quant decodes them bit for bit as the gguf package
does; the native kernels (kernels.c: decoded rows for fp32 activations, qdot.c: exact int32 dots
against q8 activation blocks) against that decoding and against linear_q8; and a file of that mix
(Q5_0 / Q5_1 next to Q8_0, Q4_1 and K-quants in fused groups, as llama-quantize and a hand-made
mix write them) loads with every matrix as blocks and decodes natively as its module path.

Blocks are the gguf package's own quantization of random weights (its writer and quantizer:
chat_fixtures.write_gguf), with edge-case scales where a test builds them by hand."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from chat_fixtures import write_gguf  # noqa: E402
from conftest import (  # noqa: E402
    check_dequantize_equals_gguf, check_native_f32_decode, check_native_q8_decode, check_qmatmul, check_rows_alone,
    greedy_against, tiny_model)
from engine.loader import load_model  # noqa: E402
from engine.quant import Q5_BLOCK_BYTES, QuantLinear, QuantStack, dequantize  # noqa: E402
from engine.steps import Stepper  # noqa: E402
from engine.steps.native.weights import regroup_q5  # noqa: E402

KINDS = {"q5_0": Q.Q5_0, "q5_1": Q.Q5_1}
TYPE_CODES = {"q5_0": 11, "q5_1": 12}   # gen.h T_Q5_0, T_Q5_1
T_Q5R = 13                               # gen.h: q5 blocks regrouped per row (weights.regroup_q5)
# SmolLM2's shape in small: rows of 96 (no multiple of 256: llama-quantize's fallback types), ffn_down's
# rows of 256 in K-quants; tied embeddings
CFG = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=4, num_attention_heads=3,
           num_key_value_heads=1, vocab_size=300, max_position_embeddings=128, rope_theta=10000.0,
           tie_word_embeddings=True)
PROMPT = torch.tensor([[5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 3]])


def blocks_of(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """The gguf package's blocks of random weights, with edge-case scales in the first block of some
    rows: zero, negative, subnormal and large fp16 d (q5_1: m too, of the other sign)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, KINDS[kind]).reshape(rows, cols // 32, Q5_BLOCK_BYTES[kind]).copy()
    for r, d in enumerate([0.0, -3e-4, 3e-8, 2.5]):
        raw[r, 0, 0:2] = np.array([d], dtype=np.float16).view(np.uint8)
        if kind == "q5_1":
            raw[r, 0, 2:4] = np.array([-d], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_dequantize_equals_gguf_bit_for_bit(kind):
    b = blocks_of(kind, 8, 352, seed=1)
    assert set(np.unique(b.numpy()[:, 2:6] if kind == "q5_0" else b.numpy()[:, 4:8])) - {0, 255}   # 5th bits vary
    check_dequantize_equals_gguf(b, kind, (8, 352), KINDS[kind])


# ------------------------------------------------------------------ the native kernels
@pytest.fixture(scope="module")
def native(native_kernels):
    return native_kernels


def as_laid(b, kind: str, rows: int, layout: str) -> tuple[torch.Tensor, int]:
    """(the bytes the C step reads, their type code): the blocks as stored, or regrouped (T_Q5R;
    q-dot tests skip it where the build has no grouped kernels)."""
    if layout == "stored":
        return b, TYPE_CODES[kind]
    return regroup_q5(b, rows, kind), T_Q5R


@pytest.mark.parametrize("layout", ["stored", "regrouped"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_native_rows_decode_as_dequantize(native, kind, layout):
    """kernels.c's decoded rows (what fp32 activations multiply, and prompt blocks widen) are
    dequantize's values, bit for bit, from the stored and the regrouped blocks (11 a row: two
    groups of 4 and 3 past them); regrouped q5_0 (d q + m, m = -16 d) writes +0 where d (q - 16)
    is -0 (d = 0 or q = 16): the same value, a zero's sign aside."""
    lib, Mat = native
    b = blocks_of(kind, 6, 352, seed=2)
    want = dequantize(b, kind, (6, 352))
    b, code = as_laid(b, kind, 6, layout)
    m = Mat(b.data_ptr(), code, 6, 352)
    for r in range(6):
        row = torch.empty(352)
        lib.row_to_f32(ctypes.byref(m), r, row.data_ptr())
        if layout == "regrouped" and kind == "q5_0":
            assert torch.equal(row, want[r]) and (row.view(torch.int32) != want[r].view(torch.int32)).sum() == \
                ((want[r] == 0) & want[r].signbit()).sum(), f"row {r}"
        else:
            assert torch.equal(row.view(torch.int32), want[r].view(torch.int32)), f"row {r}"


@pytest.mark.parametrize("layout", ["stored", "regrouped"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("B", [1, 3, 6])
def test_native_qdot_equals_linear_q8(native, kind, B, layout):
    """qdot.c's Q5 dots (exact int32 per 32-wide block against the q8 activation block, q5_0's offset
    16 as 16 sum(qx), q5_1's m as m dx sum(qx); regrouped: 4 blocks a load, the 5th bits added
    under a mask) equal linear_q8's exact sums within fp32 rounding of the per-block scaling (1e-6
    of the largest output), whatever the batch; dequantize-then-fp32 only loosely (activation
    rounding: within sum |w| max|x_block| / 254). 11 blocks a row: the kernels' pairs and groups of
    blocks and the ones left over."""
    lib, Mat = native
    if layout == "regrouped" and not lib.gen_has_q4_1r():
        pytest.skip("this build has no grouped q8 kernels (AVX-512 VNNI)")
    rows, cols = 24, 352
    b = blocks_of(kind, rows, cols, seed=3 + B)
    laid, code = as_laid(b, kind, rows, layout)
    x = torch.randn(B, cols, generator=torch.Generator().manual_seed(B))
    x[0, :32] = 0.0                       # an all-zero activation block
    x[-1, 40] = 30.0                      # an outlier
    check_qmatmul(lib, Mat(laid.data_ptr(), code, rows, cols), x, b, kind, (rows, cols), f"{kind} {layout} B{B}")


def test_q5_0_regroups_only_where_m_is_exact():
    """Regrouped q5_0 runs as d q + m with m = -16 d in f16: exact for every d up to 4094; a block
    with a larger d leaves the matrix as stored (None), never a rounded m."""
    b = blocks_of("q5_0", 4, 128, seed=5)
    assert regroup_q5(b, 4, "q5_0") is not None
    b.view(4, 4, 22)[2, 1, 0:2] = torch.from_numpy(np.array([5000.0], dtype=np.float16).view(np.uint8))
    assert regroup_q5(b, 4, "q5_0") is None


# ------------------------------------------------------------------ a file of llama-quantize's mix
def mix_types(base, k_base):
    """qtype_of for write_gguf: llama-quantize's Q4_K_M (base Q5_0, down Q4_K) or Q5_K_M (Q5_1, Q5_K)
    of a model whose rows of 96 take the fallback type: the embedding Q8_0 (tied), ffn_down Q6_K on
    even layers; and by hand, fused groups of mixed kinds: layer 0's v Q8_0 (as llama-quantize's
    "more bits" layers), layer 1's v Q4_1, layer 2's up Q4_1 (gate then up, back to back: one view)."""
    def qtype_of(name, shape):
        if name == "token_embd.weight":
            return Q.Q8_0
        layer, part = int(name.split(".")[1]), name.split(".", 2)[-1]
        if part == "ffn_down.weight":
            return Q.Q6_K if layer % 2 == 0 else k_base
        return {(0, "attn_v.weight"): Q.Q8_0, (1, "attn_v.weight"): Q.Q4_1,
                (2, "ffn_up.weight"): Q.Q4_1}.get((layer, part), base)
    return qtype_of


@pytest.fixture(scope="module", params=["Q4_K_M", "Q5_K_M"])
def q5_file(request, tmp_path_factory):
    base, k_base = (Q.Q5_0, Q.Q4_K) if request.param == "Q4_K_M" else (Q.Q5_1, Q.Q5_K)
    path = tmp_path_factory.mktemp("q5") / f"{request.param}.gguf"
    write_gguf(path, tiny_model(seed=4, **CFG), None, qtype_of=mix_types(base, k_base), template=None)
    model, _ = load_model(path)
    return request.param, base.name.lower(), k_base.name.lower(), path, model


def test_file_keeps_its_blocks(q5_file):
    """Every matrix stays in the file's blocks, the file's bytes: Q5 matrices QuantLinear, groups of
    mixed kinds a QuantStack; no float matrix anywhere in the model (the old load's fp32 copies)."""
    name, base, k_base, path, model = q5_file
    raw = {t.name: torch.from_numpy(np.asarray(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    for i, layer in enumerate(model.layers):
        qkv, o, gu, down = layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj
        assert type(o) is QuantLinear and o.kind == base and torch.equal(o.blocks, raw[f"blk.{i}.attn_output.weight"])
        assert type(down) is QuantLinear and down.kind == ("q6_k" if i % 2 == 0 else k_base)
        if i < 2:
            v_kind = ("q8_0", "q4_1")[i]
            assert type(qkv) is QuantStack and qkv.parts == ((base, 96 + 32), (v_kind, 32))
            assert torch.equal(qkv.segments()[1][2], raw[f"blk.{i}.attn_v.weight"])
        else:
            assert type(qkv) is QuantLinear and qkv.kind == base
        if i == 2:
            assert type(gu) is QuantStack and gu.parts == ((base, 256), ("q4_1", 256))
            assert torch.equal(gu.segments()[0][2], raw[f"blk.{i}.ffn_gate.weight"])
            assert torch.equal(gu.segments()[1][2], raw[f"blk.{i}.ffn_up.weight"])
        else:
            assert type(gu) is QuantLinear and gu.kind == base
    assert type(model.lm_head) is QuantLinear and model.lm_head.kind == "q8_0"
    floats = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point() and t.dim() == 2]
    assert floats == []
    from engine.steps.native import weights_read
    assert set(weights_read(model).split("+")) == {base, "q8_0", "q4_1", "q6_k", k_base}


def test_gate_up_of_two_kinds_is_a_view_of_the_map(q5_file):
    """gate (Q5) and up (Q4_1), back to back in the file, fuse without a copy."""
    from engine.loader import build
    from models.registry import read_checkpoint
    _, _, _, path, _ = q5_file
    ckpt = read_checkpoint(path)
    model = build(ckpt.config, ckpt.tensors, "cpu", torch.float32, interleaved_rotary=ckpt.interleaved_rotary)
    gate = ckpt.tensors.blocks("model.layers.2.mlp.gate_proj.weight")[0]
    assert type(model.layers[2].mlp.gate_up) is QuantStack
    assert model.layers[2].mlp.gate_up.blocks.data_ptr() == gate.data_ptr()


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_native_f32_equals_dequantize_then_fp32(native, q5_file, path):
    """fp32 activations: the same products as the module path on dequantized weights, summed in
    another order (1e-4 of the logits' scale over the prompt's 11 positions and 20 steps); greedy
    ids equal. One thread: each matrix (stacks too) runs whole."""
    name, *_, model = q5_file
    check_native_f32_decode(model, PROMPT, path, name)


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_native_q8_equals_its_reference(native, q5_file, path):
    """q8 activations: against q8_reference (the module path computing the same way), each step from
    the same state, with the bounds of the other kinds (tests/test_kquants.py: 1e-5 of the logits'
    scale on most steps, 0.1 at worst, where torch's and C's fp32 sums put an activation at a q8
    rounding tie); against dequantize-then-fp32 only loosely."""
    name, *_, model = q5_file
    check_native_q8_decode(model, PROMPT, path, name)


def test_plan_runs_regrouped_q5_blocks(native, q5_file):
    """Where the build has the grouped kernels, the q8 plan reads the Q5 matrices regrouped (T_Q5R;
    stacks as stored) and decodes the same greedy tokens as with every matrix as stored."""
    from engine.steps.native import NativeStep
    _, base, *_, model = q5_file
    ids, types = {}, {}
    for regroup in (True, False):
        step = NativeStep(model, threads=2, activations="q8", regroup=regroup)
        state = model.init_state(1, 40, "softmax")
        out = [step.prefill(PROMPT, state)[:, -1].argmax(-1)]
        for _ in range(12):
            out.append(step(out[-1][:, None], state)[:, -1].argmax(-1))
        ids[regroup] = torch.stack(out)
        tables = step.plans[state].tables
        types[regroup] = {tables["wo"][i].type for i in range(CFG["num_hidden_layers"])}
    grouped = T_Q5R if step.library.gen_has_q4_1r() else TYPE_CODES[base]
    assert types == {True: {grouped}, False: {TYPE_CODES[base]}}
    assert torch.equal(ids[True], ids[False])


def test_batched_rows_equal_each_alone(native, q5_file):
    """Q5 matrices and mixed stacks in a batch of 3 give each row the bits it gets alone (q8 decode)."""
    *_, model = q5_file
    check_rows_alone(Stepper(model, "native", threads=2, activations="q8"), model, PROMPT,
                     torch.tensor([[3], [77], [150]]))


def test_torch_step_equals_the_module_path(q5_file):
    """The PyTorch step form runs the same dequantized matrices (stacks included) as the module path."""
    *_, model = q5_file
    step = Stepper(model, "torch")
    got, want, ids, ref_ids = greedy_against(step, model, model, PROMPT, "softmax", n=6)
    assert step.last_form == "torch"
    assert ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item() <= 1e-5 and ids == ref_ids


def test_a_kind_without_kernels_runs_on_torch_with_the_reason(native, q5_file, monkeypatch):
    """A block kind the C step has no type code for (here q5's, hidden): the auto backend runs the
    torch step and says why; the kinds restored, the native step runs it again."""
    import engine.steps.native.cases as cases
    _, base, *_, model = q5_file
    monkeypatch.setattr(cases, "TYPES", {k: v for k, v in cases.TYPES.items() if k != base})
    step = Stepper(model, "auto", threads=2)
    state = model.init_state(1, 16, "softmax")
    step(PROMPT, state, last_only=True)
    step(torch.tensor([[3]]), state)
    assert step.last_form != "native" and f"no kernels for {base} blocks" in step.fallback
    monkeypatch.undo()
    state = model.init_state(1, 16, "softmax")
    step(PROMPT, state, last_only=True)
    step(torch.tensor([[3]]), state)
    assert step.last_form == "native"
