"""K-quants (a GGUF file's Q4_K / Q5_K / Q6_K super-blocks) kept as loaded: engine.quant decodes them
bit for bit as the gguf package does; the native step's kernels (kernels.c: decoded rows for fp32
activations, qdot.c: integer dots against q8 activation blocks) against that decoding and against
linear_q8; and a Q4_K_M / Q5_K_M-shaped file (llama.cpp's mix: v and down in Q6_K on some layers, the
output in Q6_K) loads as blocks and decodes natively as its dequantize-then-fp32 module path.

The gguf package cannot make K-quants (no quantizer in gguf-py), so the files hold random valid
blocks (tests/chat_fixtures.py: random_k_blocks)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from chat_fixtures import random_k_blocks, write_gguf  # noqa: E402
from conftest import (  # noqa: E402
    check_dequantize_equals_gguf, check_native_f32_decode, check_native_q8_decode, check_qmatmul, check_rows_alone,
    greedy_against, tiny_model)
from engine.loader import load_model  # noqa: E402
from engine.quant import K_BLOCK_BYTES, QuantLinear, QuantStack, dequantize  # noqa: E402
from engine.steps import Stepper  # noqa: E402

KINDS = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
TYPE_CODES = {"q4_k": 8, "q5_k": 9, "q6_k": 10}   # gen.h T_Q4_K, T_Q5_K, T_Q6_K
# hidden and intermediate sizes are multiples of 256 (a super-block); 4 layers so that llama.cpp's
# "more bits" rule puts v and down of some layers in Q6_K and leaves others in the base type
CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, rope_theta=10000.0,
           tie_word_embeddings=False)
PROMPT = torch.tensor([[5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 3]])


def blocks_of(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random blocks with edge-case scales in the first super-block of some rows: zero, negative,
    subnormal and large fp16 d / dmin."""
    raw = random_k_blocks((rows, cols), KINDS[kind], seed=seed).reshape(rows, cols // 256, K_BLOCK_BYTES[kind])
    at = slice(K_BLOCK_BYTES[kind] - 2, None) if kind == "q6_k" else slice(0, 2)
    for r, d in enumerate([0.0, -3e-4, 3e-8, 2.5]):
        raw[r, 0, at] = np.array([d], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


@pytest.mark.parametrize("kind", list(KINDS))
def test_dequantize_equals_gguf_bit_for_bit(kind):
    b = blocks_of(kind, 8, 768, seed=1)
    check_dequantize_equals_gguf(b, kind, (8, 768), KINDS[kind])


# ------------------------------------------------------------------ the native kernels
@pytest.fixture(scope="module")
def native(native_kernels):
    return native_kernels


@pytest.mark.parametrize("kind", list(KINDS))
def test_native_rows_decode_as_dequantize(native, kind):
    """kernels.c's decoded rows (what fp32 activations multiply, and prompt blocks widen) are
    dequantize's values, bit for bit."""
    lib, Mat = native
    b = blocks_of(kind, 6, 768, seed=2)
    m = Mat(b.data_ptr(), TYPE_CODES[kind], 6, 768)
    want = dequantize(b, kind, (6, 768))
    for r in range(6):
        row = torch.empty(768)
        lib.row_to_f32(ctypes.byref(m), r, row.data_ptr())
        assert torch.equal(row.view(torch.int32), want[r].view(torch.int32)), f"row {r}"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("B", [1, 3, 6])
def test_native_qdot_equals_linear_q8(native, kind, B):
    """qdot.c's K-quant dots (per 32-wide sub-block against the q8 activation block of the same
    columns, exact int32) equal linear_q8's exact sums within fp32 rounding of the per-block scaling
    (1e-6 of the largest output), whatever the batch; dequantize-then-fp32 only loosely (activation
    rounding: within sum |w| max|x_block| / 254)."""
    lib, Mat = native
    rows, cols = 24, 768
    b = blocks_of(kind, rows, cols, seed=3 + B)
    x = torch.randn(B, cols, generator=torch.Generator().manual_seed(B))
    x[0, :32] = 0.0                       # an all-zero activation block
    x[-1, 40] = 30.0                      # an outlier
    check_qmatmul(lib, Mat(b.data_ptr(), TYPE_CODES[kind], rows, cols), x, b, kind, (rows, cols), f"{kind} B{B}")


# ------------------------------------------------------------------ a Q4_K_M / Q5_K_M file
def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down a *_K_M file keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def k_m_types(base):
    """qtype_of for write_gguf: llama.cpp's Q4_K_M (base Q4_K) or Q5_K_M (base Q5_K) assignment."""
    n = CFG["num_hidden_layers"]

    def qtype_of(name, shape):
        if name == "output.weight":
            return Q.Q6_K
        if name.startswith("blk.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
            return Q.Q6_K if more_bits(int(name.split(".")[1]), n) else base
        return base
    return qtype_of


@pytest.fixture(scope="module", params=["Q4_K_M", "Q5_K_M"])
def k_m(request, tmp_path_factory):
    base = Q.Q4_K if request.param == "Q4_K_M" else Q.Q5_K
    path = tmp_path_factory.mktemp("kq") / f"{request.param}.gguf"
    write_gguf(path, tiny_model(seed=3, **CFG), None, qtype_of=k_m_types(base), template=None)
    model, _ = load_model(path)
    return request.param, base.name.lower(), path, model


def test_k_m_file_keeps_its_blocks(k_m):
    """Every matrix stays in the file's blocks: q/k/v a QuantStack where v is Q6_K, the file's bytes."""
    name, base, path, model = k_m
    n = CFG["num_hidden_layers"]
    assert {more_bits(i, n) for i in range(n)} == {True, False}      # both kinds of layer in the file
    raw = {t.name: torch.from_numpy(np.asarray(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    for i, layer in enumerate(model.layers):
        qkv, o, gu, down = layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj
        assert type(o) is QuantLinear and o.kind == base and torch.equal(o.blocks, raw[f"blk.{i}.attn_output.weight"])
        assert type(gu) is QuantLinear and gu.kind == base
        assert type(down) is QuantLinear and down.kind == ("q6_k" if more_bits(i, n) else base)
        if more_bits(i, n):
            assert type(qkv) is QuantStack and qkv.parts == ((base, 256 + 128), ("q6_k", 128))
            assert torch.equal(qkv.segments()[1][2], raw[f"blk.{i}.attn_v.weight"])
        else:
            assert type(qkv) is QuantLinear and qkv.kind == base
    assert type(model.lm_head) is QuantLinear and model.lm_head.kind == "q6_k"
    from engine.steps.native import weights_read
    assert set(weights_read(model).split("+")) == {base, "q6_k"}


def run(step, model, ref, path: str, n: int = 20, synced: bool = False):
    return greedy_against(step, model, ref, PROMPT, path, n, synced)


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_native_f32_equals_dequantize_then_fp32(native, k_m, path):
    """fp32 activations: the same products as the module path on dequantized weights, summed in
    another order: ~1e-6 of the logits' scale measured; 1e-4 allows for the prompt's 11 positions
    and 20 steps carrying that through attention. Greedy ids equal."""
    name, base, _, model = k_m
    # one thread: each matrix runs whole (the pool's chunks of 2 threads start at q/k/v's segment
    # boundary, so a stack's rows past its first segment get tested at an offset only here)
    check_native_f32_decode(model, PROMPT, path, name)


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_native_q8_equals_its_reference(native, k_m, path):
    """q8 activations (every matmul's input rounded to q8 blocks, integer dots): against
    q8_reference (the module path computing the same way), each step from the same state, with the
    bounds the 32-wide kinds are held to (tests/test_quant.py): 1e-5 of the logits' scale on most
    steps, 0.1 at worst (where torch's and C's fp32 sums put an activation at a q8 rounding tie, the
    two round it a q8 step apart: measured on random Q4_K and Q5_K models, ~1e-2 on 1 first token
    in 16, ~1e-7 on the others); and against dequantize-then-fp32 only loosely."""
    name, base, _, model = k_m
    check_native_q8_decode(model, PROMPT, path, name)


def test_batched_rows_equal_each_alone(native, k_m):
    """A K-quant stack in a batch of 3 gives each row the bits it gets alone (q8 decode)."""
    _, _, _, model = k_m
    step = Stepper(model, "native", threads=2, activations="q8")
    check_rows_alone(step, model, PROMPT, torch.tensor([[3], [77], [150]]))


def test_torch_step_equals_the_module_path(k_m):
    """The PyTorch step form runs the same dequantized matrices (stacks included) as the module path."""
    _, _, _, model = k_m
    step = Stepper(model, "torch")
    got, want, ids, ref_ids = run(step, model, model, "softmax", n=6)
    assert step.last_form == "torch"
    assert ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item() <= 1e-5 and ids == ref_ids
