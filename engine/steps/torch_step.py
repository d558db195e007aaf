"""The torch step form: `Transformer.step` for one token, with the per-token overheads removed.

The arithmetic is the module path's (`Transformer.step`, held together by
tests/test_decode_fast.py). What it saves, measured with the torch profiler on stories260K
(5 layers, dim 64), where a decode step is ~150 tiny kernels and Python overhead, not
arithmetic, is the cost:

- weights hoisted into a `DecodePlan`, built once: no `nn.Module.__call__` or attribute
  lookups per layer per token;
- q and k rotated together, and rotate_half done as one gather with a sign-folded sin table
  (rotate_half(x) * sin == x[perm] * sin_signed, exactly) instead of chunk, neg, cat, twice;
- the rotary row is one index into a table, not a slice per call; no Span positions;
- constants used as 0-dim tensors: a Python float in `x + eps` costs a tensor wrap each call;
- attention for one query is two matmuls and a softmax in `KVState.attend`, not SDPA.

The plan holds the Parameter objects themselves, so in-place updates and `.to()` (which swaps a
Parameter's storage, not the object) are seen. It is rebuilt when the model's `weights_epoch`
moves (`.to()`/`.half()`, `load_state_dict`: the model counts its own weight changes) or the
step's dtype or device differ from the plan's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.transformer import layer_weights, rms_norm


class DecodePlan:
    """Everything one decode step needs that does not change from token to token."""

    def __init__(self, model, device, dtype):
        cfg = model.config
        self.epoch, self.device, self.dtype = model.weights_epoch, device, dtype
        self.H, self.Hkv, self.D, self.inter = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                cfg.head_dim, cfg.intermediate_size)
        self.halves = [self.inter, self.inter]
        self.model = model
        self.base = in_dtype(layer_weights(model), dtype)   # what every state reads when the model has no adapters
        self.adapted = bool(model.adapted_modules())   # (merge/attach move the epoch: the plan rebuilds)
        self.by_paths: dict[tuple, list] = {}   # per layer paths -> layer_weights (adapted linear layers)
        self.embed, self.norm = model.embed_tokens.weight, model.norm.weight
        self.head = as_dtype(model.lm_head.weight, dtype)
        const = dict(device=device, dtype=torch.float32)
        self.eps = torch.tensor(cfg.rms_norm_eps, **const)
        self.width = torch.tensor(float(cfg.hidden_size), **const)
        self.head_width = torch.tensor(float(cfg.head_dim), **const)
        half = self.D // 2
        self.perm = torch.cat([torch.arange(half, self.D), torch.arange(half)]).to(device)  # rotate_half gather
        self.rope_paths = {p for p in ("softmax", "linear", "window", "hybrid") if model.uses_rope(p)}
        self.rotary = model.rotary

    def layers(self, state) -> list[tuple]:
        if not self.adapted:
            return self.base
        paths = self.model.paths_of(state)
        if paths not in self.by_paths:
            self.by_paths[paths] = in_dtype(layer_weights(self.model, paths), self.dtype)
        return self.by_paths[paths]

    def valid_for(self, model, device, dtype) -> bool:
        return self.epoch == model.weights_epoch and self.device == device and self.dtype == dtype


def as_dtype(w: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """w itself when it is in `dtype` (a Parameter: updates stay seen) or None (a bias the model lacks),
    else a copy in `dtype` (a QuantLinear's dequantized weight is fp32 whatever the model's dtype, e.g.
    --quantize q8_0 --dtype bfloat16)."""
    return w if w is None or w.dtype == dtype else w.to(dtype)


def in_dtype(layers: list[tuple], dtype) -> list[tuple]:
    return [tuple(as_dtype(w, dtype) for w in layer) for layer in layers]


def decode_one(plan: DecodePlan, tokens: torch.Tensor, state) -> torch.Tensor:
    """tokens (B, 1) int64 -> logits (B, 1, V); writes one slot into `state` and advances it.

    Called by `TorchStep`, inside inference_mode.
    """
    span = state.open(tokens)
    rotary = None
    if state.path in plan.rope_paths:
        cos, sin = plan.rotary.signed_table(span.start + 1, tokens.device, plan.embed.dtype)   # (n, D)
        if state.padded:   # sequence b sits at rotary position seen[b]
            rotary = cos[state.lengths][:, None, None], sin[state.lengths][:, None, None]    # (B, 1, 1, D)
        else:
            rotary = cos[span.start], sin[span.start]                   # (D,)
    logits = layer_stack(plan, tokens, state, rotary, lambda i, q, k, v: state.attend(i, q, k, v, span))
    state.commit(span)
    return logits


def layer_stack(plan: DecodePlan, tokens: torch.Tensor, state, rotary, attend) -> torch.Tensor:
    """The one-token layer stack every torch-based step form runs (`decode_one`; the graph form's
    `decode_static`): tokens (B, 1) -> logits (B, 1, V). rotary: (cos, sin) broadcastable against
    (B, H + Hkv, 1, D), or None (no rotary on this state's path); attend(layer, q, k, v) -> (B, H, 1, D)
    writes the layer's keys/values and attends (how positions are found is the caller's).

    Activations are kept 2-D (B, C) so each projection is one mm, and each residual add is
    folded into it as addmm (bit-identical to mm then add in fp32).
    """
    B = tokens.shape[0]
    x = F.embedding(tokens.view(B), plan.embed)                         # (B, C)
    H, Hkv, D, eps, width = plan.H, plan.Hkv, plan.D, plan.eps, plan.width
    mixed = getattr(state, "layer_paths", None)     # a hybrid state: rotary per layer
    for i, (ln1, wqkv, bqkv, qk_norm, wo, ln2, wgu, wd) in enumerate(plan.layers(state)):
        qkv = F.linear(rms_norm(x, ln1, eps, width), wqkv, bqkv).view(B, H + 2 * Hkv, 1, D)
        qk, v = qkv.split_with_sizes([H + Hkv, Hkv], 1)                            # (B, H+Hkv, 1, D), (B, Hkv, 1, D)
        if qk_norm is not None:    # Qwen3: every head of q and k normed at once, each with its own weight
            qk = rms_norm(qk, qk_norm, eps, plan.head_width)
        if rotary is not None and (mixed is None or mixed[i] in plan.rope_paths):
            qk = qk * rotary[0] + qk.index_select(-1, plan.perm) * rotary[1]
        q, k = qk.split_with_sizes([H, Hkv], 1)
        out = attend(i, q, k, v)                                       # (B, H, 1, D)
        x = torch.addmm(x, out.reshape(B, H * D), wo.t())
        gate, up = F.linear(rms_norm(x, ln2, eps, width), wgu).split_with_sizes(plan.halves, -1)
        x = torch.addmm(x, F.silu(gate) * up, wd.t())
    return F.linear(rms_norm(x, plan.norm, eps, width), plan.head).unsqueeze(1)


class TorchStep:
    """The torch form of the one-token step (see the module docstring); applies to every state."""
    name = "torch"

    def __init__(self, model):
        self.model = model
        self.plan: DecodePlan | None = None

    def why_not(self, state, tokens) -> str | None:
        return None

    def plan_for(self, tokens: torch.Tensor) -> DecodePlan:
        """The plan for a step on `tokens`' device, rebuilt when the weights, dtype or device moved
        (shared with the graph form, engine.steps.graph_step)."""
        model, plan = self.model, self.plan
        dtype = model.embed_tokens.weight.dtype
        if plan is None or not plan.valid_for(model, tokens.device, dtype):
            plan = self.plan = DecodePlan(model, tokens.device, dtype)
        return plan

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (B, 1) int64 -> logits (B, 1, V)."""
        return decode_one(self.plan_for(tokens), tokens, state)
