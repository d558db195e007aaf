"""Low-rank adapters on the attention projections of the linear layers (LoLCATs, Zhang et al. 2024,
arXiv 2410.10254): what `gen linearize --lora-rank R` trains beside the feature maps, so that a
layer run as linear attention may also adjust its q, k, v and o projections.

    qkv'(x) = qkv(x) + (x A_qkv^T) B_qkv^T        o'(y) = o_proj(y) + (y A_o^T) B_o^T

per layer, rank R. Softmax layers never read them: `--attention softmax` is the base model
unchanged, and a hybrid's softmax layers keep the base projections. The one exception is a softmax
control (`gen linearize --control`: the same finetune with softmax attention, the fair baseline of a
linearized model): its adapters go into every layer's own projections (`into_base`). At load the adapters are
merged into a second copy of each layer's qkv and o_proj (`Attention.adapted`), which every step
form reads for the layers it runs linear: W + B A in the model's dtype, or, over quantized
blocks, requantized to q8_0 (the base's blocks, dequantized, plus B A; q8_0 keeps the merge
within ~0.4% of each block's largest weight, where q4_1 would add a full q4_1 rounding).

Parameters (runtime names; checkpoint names in `models.linearized`), B holding the scale:
    qkv_a (L, R, C)   qkv_b (L, (H + 2 Hkv) D, R)   o_a (L, R, H D)   o_b (L, C, R)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.quant import QK, QuantLinear, quantize

MERGED_KIND = "q8_0"   # what adapters over quantized blocks are merged into


class LoRA(nn.Module):
    """The trainable adapters of every layer (fresh: A small random from `seed`, B zero, so the
    adapted model starts as the base)."""

    def __init__(self, layers: int, hidden: int, qkv_out: int, attn_width: int, rank: int, seed: int = 0,
                 scale: float = 2.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.scale = scale
        self.qkv_a = nn.Parameter(torch.randn(layers, rank, hidden, generator=g) / hidden ** 0.5)
        self.qkv_b = nn.Parameter(torch.zeros(layers, qkv_out, rank))
        self.o_a = nn.Parameter(torch.randn(layers, rank, attn_width, generator=g) / attn_width ** 0.5)
        self.o_b = nn.Parameter(torch.zeros(layers, hidden, rank))

    @classmethod
    def for_config(cls, cfg, rank: int, seed: int = 0) -> "LoRA":
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        return cls(cfg.num_hidden_layers, cfg.hidden_size, (H + 2 * Hkv) * D, H * D, rank, seed)

    def factors(self, layer: int, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of one projection with the scale folded into B: delta W = B A."""
        a, b = (self.qkv_a, self.qkv_b) if which == "qkv" else (self.o_a, self.o_b)
        return a[layer], b[layer] * self.scale

    def export(self) -> dict[str, torch.Tensor]:
        """Runtime-named tensors with the scale folded into B (what `merge` and the file take)."""
        return {"qkv_a": self.qkv_a.detach(), "qkv_b": self.qkv_b.detach() * self.scale,
                "o_a": self.o_a.detach(), "o_b": self.o_b.detach() * self.scale}

    def load_export(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of `export`: take adapters as the file holds them (the scale folded into B)."""
        with torch.no_grad():
            for name, t in tensors.items():
                getattr(self, name).copy_(t / self.scale if name.endswith("_b") else t)


class LowRank(nn.Module):
    """base(x) + (x A^T) B^T with A, B read from `lora` at every call (training: gradients reach
    the stacked parameters)."""

    def __init__(self, base: nn.Module, lora: LoRA, layer: int, which: str):
        super().__init__()
        self.base, self.layer, self.which = base, layer, which
        self.__dict__["lora"] = lora     # not a submodule: the LoRA's parameters are registered once

    def forward(self, x):
        a, b = self.lora.factors(self.layer, self.which)
        return self.base(x) + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))

    @property
    def weight(self):   # the effective weight (step forms that read weights)
        a, b = self.lora.factors(self.layer, self.which)
        return self.base.weight + (b @ a).to(self.base.weight.dtype)

    @property
    def bias(self):     # the base's (Qwen2's q/k/v biases): the adapters change only the matrix
        return self.base.bias


def attach(model, lora: LoRA, into_base: bool = False) -> None:
    """Every layer's adapted projections read `lora` live (training); into_base: the layer's own
    projections do, for every path (a softmax control)."""
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        pair = (LowRank(attn.qkv, lora, i, "qkv"), LowRank(attn.o_proj, lora, i, "o"))
        if into_base:
            attn.qkv, attn.o_proj = pair
        else:
            attn.adapted = pair
    model.weights_epoch += 1


def detach(model) -> None:
    for layer in model.layers:
        attn = layer.self_attn
        attn.adapted = None
        if isinstance(attn.qkv, LowRank):
            attn.qkv, attn.o_proj = attn.qkv.base, attn.o_proj.base
    model.weights_epoch += 1


def _merged(base: nn.Module, a: torch.Tensor, b: torch.Tensor) -> nn.Module:
    """base's matrix + B A (the base's bias, Qwen2's q/k/v, kept as it is)."""
    w = base.weight                                   # QuantLinear: dequantized fp32
    merged = w.float() + b.float() @ a.float()
    if isinstance(base, QuantLinear) and base.in_features % QK == 0:
        return QuantLinear(quantize(merged, MERGED_KIND), MERGED_KIND, base.in_features, base.out_features,
                           bias=base.bias, own=True)
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    out.weight = nn.Parameter(merged.to(w.dtype), requires_grad=False)
    if base.bias is not None:
        out.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
    return out.eval()


@torch.no_grad()
def merge(model, tensors: dict[str, torch.Tensor], into_base: bool = False) -> None:
    """Give every layer adapted projections: its own plus B A of `tensors` (runtime names, scale in B);
    into_base: replace the layer's own projections with those (a softmax control: every path reads them)."""
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        t = {k: v[i].to(model.device) for k, v in tensors.items()}
        pair = (_merged(attn.qkv, t["qkv_a"], t["qkv_b"]), _merged(attn.o_proj, t["o_a"], t["o_b"]))
        if into_base:
            attn.qkv, attn.o_proj = pair
        else:
            attn.adapted = pair
    model.weights_epoch += 1


__all__ = ["LoRA", "LowRank", "MERGED_KIND", "attach", "detach", "merge"]
