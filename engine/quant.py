"""Block quantization of a model's matrices at load: `--quantize q8_0|q4_0|q4_1`.

    quantize_model(model, "q8_0")          # every Linear whose input width is a multiple of 32
    blocks = quantize(w, "q4_0")           # (out, in) float -> (out, in/32 * block bytes) uint8
    w2 = dequantize(blocks, "q4_0", w.shape)

Blocks are llama.cpp's (ggml-quants.c), 32 weights along a row each:
  q8_0  fp16 d, 32 int8 q                 w = d * q          (d = max|x| / 127, q = round(x / d))
  q4_0  fp16 d, 16 bytes of nibbles       w = d * (q - 8)    (d = the signed value of largest |x| / -8)
  q4_1  fp16 d, fp16 m, 16 bytes          w = d * q + m      (m = min, d = (max - min) / 15)
Nibbles: byte j holds weight j in its low 4 bits and weight j + 16 in its high 4 bits.
A GGUF file's Q5_0 / Q5_1 (kept as loaded: `Q5_BLOCK_BYTES`; not a `--quantize` target) add a 5th bit:
  q5_0  fp16 d, 4 bytes qh, 16 bytes      w = d * (q - 16)   (q = nibble | bit j of qh (a little-endian
  q5_1  fp16 d, fp16 m, 4 bytes qh, 16    w = d * q + m       uint32) << 4, q in 0..31)

K-quants (a GGUF file's Q4_K / Q5_K / Q6_K, kept as loaded: `K_BLOCK_BYTES`; not a `--quantize`
target) are llama.cpp's super-blocks of 256 weights along a row, in 8 sub-blocks of 32 (Q6_K: 16
scales of 16 weights):
  q4_k  fp16 d, fp16 dmin, scales[12], qs[128]   w = (d sc_j) q - dmin m_j   (sc_j, m_j 6 bits, packed)
  q5_k  ... scales[12], qh[32], qs[128]           the same with q's 5th bit from qh (bit j of byte l)
  q6_k  ql[128], qh[64], int8 scales[16], fp16 d  w = (d s_i) (q - 32)        (q 6 bits: 4 in ql, 2 in qh)
`dequantize` decodes them as the gguf package does (gguf.quants, the same fp32 operations: equal bit
for bit). With q8 activations the native step takes their integer dots per 32-wide sub-block against
the same q8 activation blocks as the other kinds (`linear_q8` is the twin for them too); q5_0 /
q5_1 blocks are dotted as q4_0 / q4_1 are (offset 16 instead of 8).
A matrix fused from parts of different block kinds (Q4_K_M's q/k in Q4_K next to v in Q6_K) is a
`QuantStack`: the parts' blocks one after another, each run on its own kind.

A quantized layer is a `QuantLinear`: it keeps only the blocks (from `quantize`, or a GGUF file's
own, byte for byte: engine.loader). PyTorch forms (prefill, the torch and module steps) run
`F.linear` on `dequantize(...)`, fp32 weights. The native step computes as llama.cpp does
(engine/steps/native/qdot.c): it rounds the activations of each matmul to q8 blocks (fp32
d = max|x| / 127, int8 q = round-half-even(x / d)) and takes integer dot products per block, so
it differs from dequantize-then-fp32 by that rounding (up to 1/254 of an activation block's
largest |x| per element; on SmolLM2 +0.4% perplexity, benchmarks/quant_perplexity.py).
`linear_q8` is its PyTorch twin (exact products, fp64 sums) and `q8_reference(model)` a copy of a
model computing that way; tests hold the native matmuls to it tightly (1e-6) and the native step
to it and, loosely, to dequantize-then-fp32. (Whole steps of a deep model agree less tightly: where
torch's and C's fp32 sums put an activation at a rounding tie, the two round it one step apart.) Token embeddings stay as loaded (a lookup reads one
row per token): floats, or a GGUF file's blocks as a `QuantEmbedding` (decoding only the rows a
lookup reads); lm_head is quantized (for tied float embeddings that unties the two: the embedding
keeps its values).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.errors import InvalidArgumentError
from engine.runspec import QUANT_KINDS, check_quantize

QK = 32
QK_K = 256   # a K-quant super-block
BLOCK_BYTES = {"q8_0": 2 + QK, "q4_0": 2 + QK // 2, "q4_1": 4 + QK // 2}
KINDS = tuple(BLOCK_BYTES)   # what `--quantize` makes
assert KINDS == QUANT_KINDS, "engine.runspec.QUANT_KINDS names the kinds BLOCK_BYTES sizes"
K_BLOCK_BYTES = {"q4_k": 4 + 12 + QK_K // 2, "q5_k": 4 + 12 + QK_K // 8 + QK_K // 2,
                 "q6_k": QK_K // 2 + QK_K // 4 + QK_K // 16 + 2}
K_KINDS = tuple(K_BLOCK_BYTES)   # held as a GGUF file stores them, never made here
Q5_BLOCK_BYTES = {"q5_0": 2 + 4 + QK // 2, "q5_1": 4 + 4 + QK // 2}
Q5_KINDS = tuple(Q5_BLOCK_BYTES)  # 32-wide, held as a GGUF file stores them, never made here
WIDE_BLOCK_BYTES = {**BLOCK_BYTES, **Q5_BLOCK_BYTES}   # every 32-wide kind a QuantLinear holds
HEAD_BYTES = {"q8_0": 2, "q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}   # a 32-wide block's bytes before its weights
OFFSET = {"q4_0": 8, "q5_0": 16}   # w = d * (q - OFFSET); q4_1 / q5_1: w = d * q + m


check_kind = check_quantize   # the rule lives in engine.runspec (QUANT_KINDS == KINDS)


def check_block_kind(kind: str) -> str:
    """A kind a QuantLinear can hold: one `quantize` makes, or a Q5_0 / Q5_1 / K-quant loaded from a file."""
    if kind not in WIDE_BLOCK_BYTES and kind not in K_BLOCK_BYTES:
        raise InvalidArgumentError(f"unknown block kind {kind!r}; valid: {', '.join(KINDS + Q5_KINDS + K_KINDS)}")
    return kind


def block_weights(kind: str) -> int:
    """Weights per block of `kind` along a row: 32, or 256 for the K-quants."""
    return QK_K if check_block_kind(kind) in K_BLOCK_BYTES else QK


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of one row of `cols` weights in `kind`'s blocks."""
    return cols // block_weights(kind) * {**WIDE_BLOCK_BYTES, **K_BLOCK_BYTES}[kind]


def _half_bytes(x: torch.Tensor) -> torch.Tensor:   # (..., 1) float -> (..., 2) uint8, fp16 bits
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _half_of(b: torch.Tensor) -> torch.Tensor:      # (..., 2) uint8 -> (..., 1) fp32
    return b.contiguous().view(torch.float16).float()


def quantize(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w (out, in) float, in % 32 == 0 -> blocks (out, in / 32 * BLOCK_BYTES[kind]) uint8."""
    check_kind(kind)
    rows, cols = w.shape
    if cols % QK:
        raise InvalidArgumentError(f"{kind} needs rows of a multiple of {QK} weights, got {cols}")
    x = w.detach().float().reshape(rows, cols // QK, QK)
    if kind == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        v = x * inv
        q = (v.sign() * (v.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)   # roundf: half away from 0
        return torch.cat([_half_bytes(d), q.view(torch.uint8)], -1).reshape(rows, -1)
    if kind == "q4_0":
        big = x.gather(-1, x.abs().argmax(-1, keepdim=True))                        # signed, largest |x|
        d = big / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (x * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        packed = q[..., :QK // 2] | (q[..., QK // 2:] << 4)
        return torch.cat([_half_bytes(d), packed], -1).reshape(rows, -1)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = ((x - lo) * inv + 0.5).trunc().clamp(0, 15).to(torch.uint8)
    packed = q[..., :QK // 2] | (q[..., QK // 2:] << 4)
    return torch.cat([_half_bytes(d), _half_bytes(lo), packed], -1).reshape(rows, -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k / q5_k's 12 packed bytes (..., 12) -> the 8 sub-blocks' 6-bit scales and mins (..., 8) int32:
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3, 8-11 the low 4 bits of scales 4-7 (low
    nibble) and mins 4-7 (high nibble), whose top 2 bits are the top 2 bits of bytes 0-3 / 4-7."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], -1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], -1)
    return sc, mn


def _k_values(b: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Super-blocks (..., bytes) -> (q (..., 8, 32) or (..., 16, 16) int32, scale (..., n, 1) as
    d * sc in fp32, offset (..., n, 1) fp32): w = scale * q - offset (q6_k: offset 0, q already
    less 32), the fp32 operations and their order as gguf.quants'."""
    if kind == "q6_k":
        ql, qh, sc = b[..., :128].to(torch.int32), b[..., 128:192].to(torch.int32), b[..., 192:208]
        d = _half_of(b[..., 208:210])                                               # (..., 1)
        ql = ql.reshape(*b.shape[:-1], 2, 1, 64) >> torch.tensor([0, 4]).reshape(2, 1)
        qh = qh.reshape(*b.shape[:-1], 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(4, 1)
        q = (ql & 15).reshape(*b.shape[:-1], 8, 32) | ((qh & 3).reshape(*b.shape[:-1], 8, 32) << 4)
        scale = (d * sc.contiguous().view(torch.int8).float()).unsqueeze(-1)       # (..., 16, 1)
        return (q - 32).reshape(*b.shape[:-1], 16, 16), scale, torch.zeros_like(scale)
    d, dmin = _half_of(b[..., 0:2]), _half_of(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., -128:].to(torch.int32).reshape(*b.shape[:-1], 4, 1, 32) >> torch.tensor([0, 4]).reshape(2, 1)
    q = (qs & 15).reshape(*b.shape[:-1], 8, 32)
    if kind == "q5_k":
        qh = b[..., 16:48].to(torch.int32).reshape(*b.shape[:-1], 1, 32) >> torch.arange(8).reshape(8, 1)
        q = q | ((qh & 1) << 4)
    return q, (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)


def dequantize(blocks: torch.Tensor, kind: str, shape) -> torch.Tensor:
    """blocks (out, in / 32 * bytes) uint8 -> (out, in) fp32, exactly as the native kernels decode them
    (K-quants: in / 256 super-blocks a row; bit for bit gguf.quants.dequantize)."""
    rows, cols = shape
    if kind in K_BLOCK_BYTES:
        q, scale, offset = _k_values(blocks.reshape(rows, cols // QK_K, K_BLOCK_BYTES[kind]), kind)
        return (scale * q.float() - offset).reshape(rows, cols)
    b = blocks.reshape(rows, cols // QK, WIDE_BLOCK_BYTES[check_block_kind(kind)])
    d = _half_of(b[..., 0:2])                                                        # (rows, nb, 1)
    if kind == "q8_0":
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        q = _nibble_values(b, kind).float()                                          # (rows, nb, 32)
        w = d * (q - OFFSET[kind]) if kind in OFFSET else d * q + _half_of(b[..., 2:4])
    return w.reshape(rows, cols)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float, K % 32 == 0 -> (q (..., K/32, 32) int8 values as int32, d (..., K/32) fp32), as
    qdot.c's quantize_x: d = max|x| / 127 per block, q = round-half-even(x * (1 / d)), all in fp32."""
    xb = x.detach().float().reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (xb * inv.unsqueeze(-1)).round().to(torch.int32), d


def _nibble_values(b: torch.Tensor, kind: str) -> torch.Tensor:
    """The weights' integers of q4_0 / q4_1 / q5_0 / q5_1 blocks (..., bytes) -> (..., 32) uint8: the
    nibbles (byte j: weight j low, j + 16 high), for q5 ORed with 16 where weight j's bit of qh (the 4
    bytes before the nibbles, a little-endian uint32) is set."""
    head = HEAD_BYTES[kind]
    qs = b[..., head:]
    q = torch.cat([qs & 0x0F, qs >> 4], -1)
    if kind in Q5_BLOCK_BYTES:
        bits = (b[..., head - 4:head].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=b.device)) & 1
        q = q | (bits.reshape(q.shape) << 4)                                          # (..., 4, 8): byte, bit
    return q


def block_integers(blocks: torch.Tensor, kind: str, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A matrix's 32-wide blocks as (q (rows, nb, 32) int32, d (rows, nb) fp32, m (rows, nb) fp32 or zeros):
    w = d * q (q8_0), d * (q - 8) (q4_0, q in 0..15), d * q + m (q4_1), d * (q - 16) (q5_0, q in 0..31),
    d * q + m (q5_1)."""
    rows, cols = shape
    if check_block_kind(kind) not in WIDE_BLOCK_BYTES:
        raise InvalidArgumentError(f"{kind} is not a kind of 32-wide blocks")
    b = blocks.reshape(rows, cols // QK, WIDE_BLOCK_BYTES[kind])
    d = _half_of(b[..., 0:2]).squeeze(-1)
    m = _half_of(b[..., 2:4]).squeeze(-1) if kind in ("q4_1", "q5_1") else torch.zeros_like(d)
    if kind == "q8_0":
        return b[..., 2:].contiguous().view(torch.int8).to(torch.int32), d, m
    return _nibble_values(b, kind).to(torch.int32), d, m


def linear_q8(x: torch.Tensor, blocks: torch.Tensor, kind: str, shape) -> torch.Tensor:
    """The native step's quantized matmul in PyTorch: x (..., in) -> (..., out) fp32.

    Activations rounded to q8 blocks (`quantize_activations`), then sum_k dw dx (qw . qx) per block
    (q4_0 / q5_0: dw (qw - 8 / 16), q4_1 / q5_1: dw qw + m) -- computed as one fp64 matmul of the exactly decoded
    activations (qx * dx) and weights (dw * qw (+ m)), which is the same sum: exact products, fp64
    rounding (~1e-16) where the C code rounds its per-block scaling and sums to fp32."""
    rows, cols = shape
    qx, dx = quantize_activations(x.reshape(-1, cols))              # (N, nb, 32), (N, nb)
    xs = (qx.double() * dx.double().unsqueeze(-1)).reshape(-1, cols)
    if kind in K_BLOCK_BYTES:   # every product in the weights is exact in fp64
        q, scale, offset = _k_values(blocks.reshape(rows, cols // QK_K, K_BLOCK_BYTES[kind]), kind)
        ws = (scale.double() * q.double() - offset.double()).reshape(rows, cols)
        return (xs @ ws.T).float().reshape(*x.shape[:-1], rows)
    qw, dw, mw = block_integers(blocks, kind, shape)                 # (rows, nb, 32), (rows, nb) x2
    q = qw.double() - OFFSET.get(kind, 0)
    ws = (q * dw.double().unsqueeze(-1) + mw.double().unsqueeze(-1)).reshape(rows, cols)
    return (xs @ ws.T).float().reshape(*x.shape[:-1], rows)


GROUP_HEAD = {"q4_1": 4, "q8_0": 2}   # the kinds `group_rows` lays out, and their blocks' head bytes


def group_rows(blocks: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
    """q4_1 / q8_0 blocks (rows, row bytes) regrouped per row for the native step's grouped kernels
    (gen.h T_Q4_1R / T_Q8_0R): q4_1 (20 bytes: f16 d, f16 m, 16 nibble bytes) as every (d, m) pair,
    then every nibble block; q8_0 (34 bytes: f16 d, 32 int8) as every d, then every block's 32 weights.
    The kernels read 4 blocks' weights in one or two loads. Bytes moved into the one new tensor (no
    temporaries: a copy of the model's size would leave the heap fragmented after it is freed), none
    changed. `ungroup_rows` is its inverse."""
    size, head = WIDE_BLOCK_BYTES[kind], GROUP_HEAD[kind]
    per_row = blocks.reshape(rows, -1, size)
    n = per_row.shape[1]
    out = torch.empty(rows, n * size, dtype=torch.uint8, device=blocks.device)
    out[:, :n * head].view(rows, n, head).copy_(per_row[:, :, :head])
    out[:, n * head:].view(rows, n, size - head).copy_(per_row[:, :, head:])
    return out


def ungroup_rows(grouped: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
    """The blocks as stored (rows, row bytes) from `group_rows`' layout: a new tensor, byte for byte."""
    size, head = WIDE_BLOCK_BYTES[kind], GROUP_HEAD[kind]
    g = grouped.reshape(rows, -1)
    n = g.shape[1] // size
    out = torch.empty(rows, n, size, dtype=torch.uint8, device=grouped.device)
    out[:, :, :head].copy_(g[:, :n * head].view(rows, n, head))
    out[:, :, head:].copy_(g[:, n * head:].view(rows, n, size - head))
    return out.reshape(rows, n * size)


class QuantLinear(nn.Module):
    """A Linear whose weight is kept as quantized blocks (`blocks`, uint8); its bias, if any (Qwen2's
    q/k/v), stays a float Parameter.

    own: the blocks are this module's own memory (a copy: fused parts, `--quantize`, merged
    adapters), not a view of a checkpoint's map. Such q4_1 / q8_0 blocks may be held in the native
    step's grouped layout instead (`group`, which that step calls: then it reads them as they are
    instead of keeping a regrouped copy beside them; `grouped` says which); every PyTorch form reads
    `stored_blocks()`, the blocks as stored either way."""
    own = grouped = False   # (QuantStack and QuantEmbedding keep these defaults: never grouped)

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, own: bool = False):
        super().__init__()
        self.kind, self.in_features, self.out_features = check_block_kind(kind), in_features, out_features
        self.own, self.grouped = bool(own), False
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> "QuantLinear":
        return cls(quantize(linear.weight, kind), kind, linear.in_features, linear.out_features, bias=linear.bias,
                   own=True)

    def stored_blocks(self) -> torch.Tensor:
        """The blocks in their stored layout (a new tensor where they are held grouped)."""
        return ungroup_rows(self.blocks, self.out_features, self.kind) if self.grouped else self.blocks

    def group(self) -> bool:
        """Hold own q4_1 / q8_0 blocks in `group_rows`' layout (the old tensor freed: one copy stays). True
        where they are now grouped; False (nothing changed) for blocks viewing a checkpoint, another kind,
        or a subclass."""
        if not self.grouped and self.own and type(self) is QuantLinear and self.kind in GROUP_HEAD \
                and self.blocks.is_contiguous():
            with torch.no_grad():
                self.blocks = group_rows(self.blocks, self.out_features, self.kind)
            self.grouped = True
        return self.grouped

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (out, in) fp32 weight (a new tensor each call)."""
        return dequantize(self.stored_blocks(), self.kind, (self.out_features, self.in_features))

    def forward(self, x):   # (..., in) -> (..., out), on the dequantized weights
        w, b = self.weight, self.bias
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), b if b is None or b.dtype == x.dtype
                        else b.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind}" + (", grouped" if self.grouped else "")


class QuantLinearQ8(QuantLinear):
    """A QuantLinear computing as the native step does (`linear_q8`): the reference twin of qdot.c."""

    def forward(self, x):   # (..., in) -> (..., out)
        y = linear_q8(x, self.stored_blocks(), self.kind, (self.out_features, self.in_features))
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


class QuantStack(QuantLinear):
    """A matrix fused from row parts of different block kinds (a Q4_K_M file's q and k in Q4_K, v in
    Q6_K): `parts` ((kind, rows), ...) top to bottom, `blocks` every part's rows of blocks one after
    another (1-D uint8), `kind` their kinds joined by "+". Each part computes as a QuantLinear of its
    kind; the native step runs the parts as segments of one matrix."""

    def __init__(self, blocks: torch.Tensor, parts, in_features: int, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.parts = tuple((check_block_kind(k), int(r)) for k, r in parts)
        self.kind = "+".join(k for k, _ in self.parts)
        self.in_features, self.out_features = in_features, sum(r for _, r in self.parts)
        if blocks.numel() != sum(r * row_bytes(k, in_features) for k, r in self.parts):
            raise InvalidArgumentError(f"{blocks.numel()} bytes of blocks do not hold parts {self.parts} "
                                       f"of {in_features} columns")
        self.register_buffer("blocks", blocks.reshape(-1))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def segments(self) -> list[tuple[str, int, torch.Tensor]]:
        """(kind, rows, that part's blocks (rows, row bytes)) top to bottom (views of `blocks`)."""
        out, at = [], 0
        for kind, rows in self.parts:
            n = rows * row_bytes(kind, self.in_features)
            out.append((kind, rows, self.blocks[at:at + n].view(rows, -1)))
            at += n
        return out

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([dequantize(b, k, (r, self.in_features)) for k, r, b in self.segments()])

    def forward_q8(self, x):   # (..., in) -> (..., out), each part as linear_q8
        y = torch.cat([linear_q8(x, b, k, (r, self.in_features)) for k, r, b in self.segments()], -1)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


class QuantStackQ8(QuantStack):
    """A QuantStack computing as the native step does (each part's `linear_q8`)."""

    def forward(self, x):
        return self.forward_q8(x)


class QuantEmbedding(QuantStack):
    """A token embedding kept as its blocks (a GGUF file's Q8_0 / Q4_K / Q6_K ... table, for a tied
    lm_head the very tensor the head reads): a lookup decodes only the rows it reads, to `dtype`
    (the model's; `.half()` / `.to(dtype)` move it), the values a dequantized table holds bit for bit.

    It is a QuantStack of one part (rows = vocabulary, in_features = hidden size), so the native
    step reads its rows as stored (gen.h's row_to_f32 decodes every stored kind; a stack is never
    regrouped). `weight` is a `BlockTable`: a tensor of the table's dtype, shape and device that holds
    no values; F.embedding and row slices on it decode only their rows, any other op the whole table
    for that op."""

    def __init__(self, blocks: torch.Tensor, kind: str, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__(blocks, [(kind, num_embeddings)], embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # 0 elements: carries the lookup's dtype (and device) through .to()/.half(); not in state_dict
        self.register_buffer("probe", torch.empty(0, dtype=dtype, device=blocks.device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.probe.dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int -> (..., embedding_dim) in `dtype`: those rows of blocks, decoded."""
        kind, n = self.parts[0][0], row_bytes(self.parts[0][0], self.in_features)
        picked = self.blocks.view(self.num_embeddings, n).index_select(0, ids.reshape(-1).to(self.blocks.device))
        return dequantize(picked, kind, (picked.shape[0], self.in_features)).to(self.dtype).reshape(
            *ids.shape, self.in_features)

    def forward(self, ids):   # (...) -> (..., embedding_dim)
        return self.rows(ids)

    def table(self) -> torch.Tensor:
        """The whole (num_embeddings, embedding_dim) table in `dtype` (a new tensor each call)."""
        return super().weight.to(self.dtype)

    @property
    def weight(self) -> "BlockTable":
        return BlockTable(self)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}, {str(self.dtype).removeprefix('torch.')}"


class BlockTable(torch.Tensor):
    """A QuantEmbedding's table as a tensor without values (`QuantEmbedding.weight`): what reads
    `embed_tokens.weight` for its dtype, device or shape (step forms, Transformer.dtype), looks rows
    up in it (F.embedding: the torch step) or slices rows off it (a state's weight fingerprint)
    decodes no more than those rows; any other op decodes the whole table, for that op only."""

    __torch_function__ = torch._C._disabled_torch_function_impl   # every op reaches __torch_dispatch__

    @staticmethod
    def __new__(cls, emb: QuantEmbedding):
        t = torch.Tensor._make_wrapper_subclass(cls, (emb.num_embeddings, emb.embedding_dim), dtype=emb.dtype,
                                                device=emb.blocks.device, requires_grad=False)
        t.emb = emb
        return t

    def __repr__(self):
        return f"BlockTable({self.emb.extra_repr()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten.embedding.default and isinstance(args[0], cls):
            return args[0].emb.rows(args[1])
        if func is aten.slice.Tensor and isinstance(args[0], cls) and not kwargs:
            t, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1:])[:5]
            if dim == 0:
                return t.emb.rows(torch.arange(t.shape[0])[start:end:step])
        if func in (aten.detach.default, aten.alias.default) and isinstance(args[0], cls):
            return cls(args[0].emb)
        args, kwargs = torch.utils._pytree.tree_map_only(cls, lambda t: t.emb.table(), (args, kwargs))
        return func(*args, **kwargs)


def q8_reference(model):
    """A deep copy of `model` whose QuantLinear layers round their activations to q8 blocks and take
    integer dot products, as the native step (tests run its module path as the reference)."""
    ref = copy.deepcopy(model)

    def q8(m):
        if type(m) is QuantStack:
            return QuantStackQ8(m.blocks, m.parts, m.in_features, m.bias)
        return QuantLinearQ8(m.stored_blocks(), m.kind, m.in_features, m.out_features, m.bias) \
            if type(m) is QuantLinear else m

    for name, module in list(ref.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) in (QuantLinear, QuantStack):
                setattr(module, child_name, q8(child))
    ref.map_adapted(q8)                                     # the linear layers' adapted projections
    return ref


def quantizable(linear) -> bool:
    return isinstance(linear, nn.Linear) and linear.in_features % QK == 0


def quantize_model(model, kind: str) -> list[str]:
    """Replace the model's matrices (per layer qkv, o_proj, gate_up, down_proj; lm_head) by
    QuantLinear in place. Returns the names of the matrices left as they were (input width not a
    multiple of 32, e.g. stories260K's down_proj with 172 inputs). A matrix already quantized
    (a GGUF file's blocks) keeps its blocks when `kind` is its own, else is requantized from
    its dequantized weights."""
    check_kind(kind)
    kept = []
    targets = [(f"layers.{i}.self_attn", layer.self_attn, n) for i, layer in enumerate(model.layers)
               for n in ("qkv", "o_proj")]
    targets += [(f"layers.{i}.mlp", layer.mlp, n) for i, layer in enumerate(model.layers)
                for n in ("gate_up", "down_proj")]
    targets.append(("", model, "lm_head"))

    def quantized(module):
        if quantizable(module):
            return QuantLinear.from_linear(module, kind)
        if isinstance(module, QuantLinear) and module.kind != kind:
            return QuantLinear(quantize(module.weight, kind), kind, module.in_features, module.out_features,
                               bias=module.bias, own=True)
        return module

    with torch.no_grad():
        for prefix, parent, name in targets:
            module = getattr(parent, name)
            new = quantized(module)
            setattr(parent, name, new)
            if not isinstance(new, QuantLinear):
                kept.append(f"{prefix}.{name}".lstrip("."))
        model.map_adapted(quantized)
    model.weights_epoch += 1
    model.quantization = kind
    return kept


def weights_label(model, view=None) -> str:
    """What the step's matrices (projections and lm_head; not the embedding lookup) hold, most bytes
    first: "float32", "float16", or block kinds such as "q4_1+q8_0" (a GGUF file's Q4_1 matrices
    with a Q8_0 lm_head; smollm2-linear's adapted q8_0 copies count too). view(weight): the tensor a
    step form reads instead of a float weight."""
    sizes: dict[str, int] = {}
    for module in [*model.modules(), *model.adapted_modules()]:   # with the linear layers' adapted copies
        if isinstance(module, QuantEmbedding):
            continue
        if isinstance(module, QuantStack):
            for kind, _, b in module.segments():
                sizes[kind] = sizes.get(kind, 0) + b.numel()
            continue
        if isinstance(module, QuantLinear):
            name, size = module.kind, module.blocks.numel()
        elif isinstance(module, nn.Linear):
            w = view(module.weight) if view else module.weight
            name, size = str(w.dtype).removeprefix("torch."), w.nbytes
        else:
            continue
        sizes[name] = sizes.get(name, 0) + size
    return "+".join(sorted(sizes, key=lambda k: -sizes[k])) or str(model.dtype).removeprefix("torch.")


def dequantize_model(model) -> None:
    """Replace every QuantLinear (e.g. a GGUF file's blocks) by an nn.Linear holding its dequantized
    weight (and its bias) in the model's dtype, in place: the float form of the same weights."""
    def floats(child):
        if isinstance(child, QuantEmbedding):
            return nn.Embedding.from_pretrained(child.table().to(model.dtype), freeze=True)   # no random init
        if not isinstance(child, QuantLinear):
            return child
        lin = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
        lin.weight = nn.Parameter(child.weight.to(model.dtype), requires_grad=False)
        if child.bias is not None:
            lin.bias = nn.Parameter(child.bias.detach().to(model.dtype), requires_grad=False)
        return lin

    with torch.no_grad():
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                setattr(module, name, floats(child))
        model.map_adapted(floats)
    model.weights_epoch += 1

