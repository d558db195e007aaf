"""Block quantization of a model's matrices at load: `--quantize q8_0|q4_0|q4_1`.

    quantize_model(model, "q8_0")          # every Linear whose input width is a multiple of 32
    blocks = quantize(w, "q4_0")           # (out, in) float -> (out, in/32 * block bytes) uint8
    w2 = dequantize(blocks, "q4_0", w.shape)

Blocks are llama.cpp's (ggml-quants.c), 32 weights along a row each:
  q8_0  fp16 d, 32 int8 q                 w = d * q          (d = max|x| / 127, q = round(x / d))
  q4_0  fp16 d, 16 bytes of nibbles       w = d * (q - 8)    (d = the signed value of largest |x| / -8)
  q4_1  fp16 d, fp16 m, 16 bytes          w = d * q + m      (m = min, d = (max - min) / 15)
Nibbles: byte j holds weight j in its low 4 bits and weight j + 16 in its high 4 bits.

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
row per token); lm_head is quantized (for tied embeddings that unties the two: the embedding
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
BLOCK_BYTES = {"q8_0": 2 + QK, "q4_0": 2 + QK // 2, "q4_1": 4 + QK // 2}
KINDS = tuple(BLOCK_BYTES)
assert KINDS == QUANT_KINDS, "engine.runspec.QUANT_KINDS names the kinds BLOCK_BYTES sizes"


check_kind = check_quantize   # the rule lives in engine.runspec (QUANT_KINDS == KINDS)


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


def dequantize(blocks: torch.Tensor, kind: str, shape) -> torch.Tensor:
    """blocks (out, in / 32 * bytes) uint8 -> (out, in) fp32, exactly as the native kernels decode them."""
    rows, cols = shape
    b = blocks.reshape(rows, cols // QK, BLOCK_BYTES[check_kind(kind)])
    d = _half_of(b[..., 0:2])                                                        # (rows, nb, 1)
    if kind == "q8_0":
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[..., 4:] if kind == "q4_1" else b[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], -1).float()                              # (rows, nb, 32)
        w = d * (q - 8) if kind == "q4_0" else d * q + _half_of(b[..., 2:4])
    return w.reshape(rows, cols)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float, K % 32 == 0 -> (q (..., K/32, 32) int8 values as int32, d (..., K/32) fp32), as
    qdot.c's quantize_x: d = max|x| / 127 per block, q = round-half-even(x * (1 / d)), all in fp32."""
    xb = x.detach().float().reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (xb * inv.unsqueeze(-1)).round().to(torch.int32), d


def block_integers(blocks: torch.Tensor, kind: str, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A matrix's blocks as (q (rows, nb, 32) int32, d (rows, nb) fp32, m (rows, nb) fp32 or zeros):
    w = d * q (q8_0), d * (q - 8) (q4_0, q in 0..15), d * q + m (q4_1)."""
    rows, cols = shape
    b = blocks.reshape(rows, cols // QK, BLOCK_BYTES[check_kind(kind)])
    d = _half_of(b[..., 0:2]).squeeze(-1)
    m = _half_of(b[..., 2:4]).squeeze(-1) if kind == "q4_1" else torch.zeros_like(d)
    if kind == "q8_0":
        return b[..., 2:].contiguous().view(torch.int8).to(torch.int32), d, m
    qs = b[..., 4:] if kind == "q4_1" else b[..., 2:]
    return torch.cat([qs & 0x0F, qs >> 4], -1).to(torch.int32), d, m


def linear_q8(x: torch.Tensor, blocks: torch.Tensor, kind: str, shape) -> torch.Tensor:
    """The native step's quantized matmul in PyTorch: x (..., in) -> (..., out) fp32.

    Activations rounded to q8 blocks (`quantize_activations`), then sum_k dw dx (qw . qx) per block
    (q4_0: dw (qw - 8), q4_1: dw qw + m) -- computed as one fp64 matmul of the exactly decoded
    activations (qx * dx) and weights (dw * qw (+ m)), which is the same sum: exact products, fp64
    rounding (~1e-16) where the C code rounds its per-block scaling and sums to fp32."""
    rows, cols = shape
    qx, dx = quantize_activations(x.reshape(-1, cols))              # (N, nb, 32), (N, nb)
    qw, dw, mw = block_integers(blocks, kind, shape)                 # (rows, nb, 32), (rows, nb) x2
    xs = (qx.double() * dx.double().unsqueeze(-1)).reshape(-1, cols)
    q = qw.double() - 8 if kind == "q4_0" else qw.double()
    ws = (q * dw.double().unsqueeze(-1) + mw.double().unsqueeze(-1)).reshape(rows, cols)
    return (xs @ ws.T).float().reshape(*x.shape[:-1], rows)


class QuantLinear(nn.Module):
    """A Linear whose weight is kept as quantized blocks (`blocks`, uint8); its bias, if any (Qwen2's
    q/k/v), stays a float Parameter."""

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.in_features, self.out_features = check_kind(kind), in_features, out_features
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> "QuantLinear":
        return cls(quantize(linear.weight, kind), kind, linear.in_features, linear.out_features, bias=linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (out, in) fp32 weight (a new tensor each call)."""
        return dequantize(self.blocks, self.kind, (self.out_features, self.in_features))

    def forward(self, x):   # (..., in) -> (..., out), on the dequantized weights
        w, b = self.weight, self.bias
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), b if b is None or b.dtype == x.dtype
                        else b.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind}"


class QuantLinearQ8(QuantLinear):
    """A QuantLinear computing as the native step does (`linear_q8`): the reference twin of qdot.c."""

    def forward(self, x):   # (..., in) -> (..., out)
        y = linear_q8(x, self.blocks, self.kind, (self.out_features, self.in_features))
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


def q8_reference(model):
    """A deep copy of `model` whose QuantLinear layers round their activations to q8 blocks and take
    integer dot products, as the native step (tests run its module path as the reference)."""
    ref = copy.deepcopy(model)

    def q8(m):
        return QuantLinearQ8(m.blocks, m.kind, m.in_features, m.out_features, m.bias) if type(m) is QuantLinear else m

    for name, module in list(ref.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is QuantLinear:
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
                               bias=module.bias)
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

