"""The lean one-token step: `Transformer.step` for T = 1, with the per-token overheads removed.

The arithmetic is the module path's (`Transformer.step` with `fast_decode = False`; held
together by tests/test_decode_fast.py). What it saves, measured with the torch profiler on
stories260K (5 layers, dim 64), where a decode step is ~150 tiny kernels and Python overhead,
not arithmetic, is the cost:

- weights hoisted into a `DecodePlan`, built once: no `nn.Module.__call__` or attribute
  lookups per layer per token;
- q and k rotated together, and rotate_half done as one gather with a sign-folded sin table
  (rotate_half(x) * sin == x[perm] * sin_signed, exactly) instead of chunk, neg, cat, twice;
- the rotary row is one index into a table, not a slice per call; no Block positions;
- constants used as 0-dim tensors: a Python float in `x + eps` costs a tensor wrap each call;
- attention for one query is two matmuls and a softmax in `KVState.attend`, not SDPA.

The plan holds the Parameter objects themselves, so in-place updates (training, `.to()`) are
seen; it is rebuilt when any module registers a parameter or submodule (load_state_dict with
assign=True, re-tied weights), which the process-wide registration hooks below count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

_EPOCH = 0   # bumped whenever any module registers a parameter or a submodule


def _bump(*_):
    global _EPOCH
    _EPOCH += 1


register_module_parameter_registration_hook(_bump)
register_module_module_registration_hook(_bump)


def rms_norm(x, weight, eps, n):
    """RMSNorm in fp32 like Hugging Face Llama; x (..., C). eps, n: floats or 0-dim tensors.

    (x * x).sum / n is bit-identical to x.pow(2).mean (torch's mean is sum then div_), and
    addcdiv(eps, s, n) to s / n + eps; with 0-dim tensors for eps and n that is 7 kernels, no
    scalar wrapping.
    """
    x32 = x if x.dtype == torch.float32 else x.float()
    if isinstance(eps, torch.Tensor):
        r = torch.addcdiv(eps, (x32 * x32).sum(-1, keepdim=True), n).rsqrt_()
    else:
        r = (x32 * x32).sum(-1, keepdim=True).div_(n).add_(eps).rsqrt_()
    return weight * (x32 * r if x.dtype == torch.float32 else (x32 * r).to(x.dtype))


def layer_weights(model) -> list[tuple]:
    """Per layer, the weights one decode step reads: (ln1, qkv, o, ln2, gate_up, down)."""
    return [(b.input_layernorm.weight, b.self_attn.qkv.weight, b.self_attn.o_proj.weight,
             b.post_attention_layernorm.weight, b.mlp.gate_up.weight, b.mlp.down_proj.weight)
            for b in model.layers]


class DecodePlan:
    """Everything one decode step needs that does not change from token to token."""

    def __init__(self, model, device, dtype):
        cfg = model.config
        self.epoch, self.device, self.dtype = _EPOCH, device, dtype
        self.H, self.Hkv, self.D, self.inter = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                cfg.head_dim, cfg.intermediate_size)
        self.halves = [self.inter, self.inter]
        self.layers = layer_weights(model)
        self.embed, self.norm, self.head = model.embed_tokens.weight, model.norm.weight, model.lm_head.weight
        const = dict(device=device, dtype=torch.float32)
        self.eps = torch.tensor(cfg.rms_norm_eps, **const)
        self.width = torch.tensor(float(cfg.hidden_size), **const)
        half = self.D // 2
        self.perm = torch.cat([torch.arange(half, self.D), torch.arange(half)]).to(device)  # rotate_half gather
        self.rope_paths = {p for p in ("softmax", "linear") if model.uses_rope(p)}
        self.rotary = model.rotary

    def valid_for(self, device, dtype) -> bool:
        return self.epoch == _EPOCH and self.device == device and self.dtype == dtype


def decode_one(plan: DecodePlan, tokens: torch.Tensor, state) -> torch.Tensor:
    """tokens (B, 1) int64 -> logits (B, 1, V); writes one slot into `state` and advances it.

    Called by `Transformer.step`, inside its inference_mode.

    Activations are kept 2-D (B, C) so each projection is one mm, and each residual add is
    folded into it as addmm (bit-identical to mm then add in fp32).
    """
    block = state.begin(tokens)
    B = tokens.shape[0]
    x = F.embedding(tokens.view(B), plan.embed)                         # (B, C)
    H, Hkv, D, eps, width = plan.H, plan.Hkv, plan.D, plan.eps, plan.width
    rope = state.path in plan.rope_paths
    if rope:
        cos, sin = plan.rotary.signed_table(block.start + 1, x.device, x.dtype)   # (n, D)
        if state.padded:   # sequence b sits at rotary position seen[b]
            cos, sin = cos[state.seen][:, None, None], sin[state.seen][:, None, None]  # (B, 1, 1, D)
        else:
            cos, sin = cos[block.start], sin[block.start]               # (D,)
    for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(plan.layers):
        qkv = F.linear(rms_norm(x, ln1, eps, width), wqkv).view(B, H + 2 * Hkv, 1, D)
        qk, v = qkv.split_with_sizes([H + Hkv, Hkv], 1)                            # (B, H+Hkv, 1, D), (B, Hkv, 1, D)
        if rope:
            qk = qk * cos + qk.index_select(-1, plan.perm) * sin
        q, k = qk.split_with_sizes([H, Hkv], 1)
        out = state.attend(i, q, k, v, block)                           # (B, H, 1, D)
        x = torch.addmm(x, out.reshape(B, H * D), wo.t())
        gate, up = F.linear(rms_norm(x, ln2, eps, width), wgu).split_with_sizes(plan.halves, -1)
        x = torch.addmm(x, F.silu(gate) * up, wd.t())
    state.end(block)
    return F.linear(rms_norm(x, plan.norm, eps, width), plan.head).unsqueeze(1)
