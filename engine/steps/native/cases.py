"""Which (model, state, tokens) the C step covers: `why_not` names every other case, and the
Stepper hands it to the torch form with that reason."""
from __future__ import annotations

import torch

from engine.quant import QuantLinear, QuantStack
from engine.steps.native.abi import FLOAT_TYPES, HEDGEHOG_MAX_D, MODES, TYPES


def state_parts(state) -> tuple:
    """(KV cache part or None, linear or window part or None) of a softmax, linear, window or hybrid state."""
    parts = state.parts if state.path == "hybrid" else [state]
    return (next((p for p in parts if p.path == "softmax"), None),
            next((p for p in parts if p.path != "softmax"), None))


def learned_maps(fmap) -> list[torch.Tensor]:
    """A hedgehog map's tensors in gen.h's order: q_weight (L, H, D, D), q_bias, k_weight, k_bias."""
    return [fmap.q_weight, fmap.q_bias, fmap.k_weight, fmap.k_bias]


def block_kinds(model) -> set[str]:
    """The block kinds of the model's quantized matrices (a QuantStack's parts each), adapted copies too."""
    kinds = set()
    for m in [*model.modules(), *model.adapted_modules()]:
        if isinstance(m, QuantStack):
            kinds.update(k for k, _ in m.parts)
        elif isinstance(m, QuantLinear):
            kinds.add(m.kind)
    return kinds


def why_not(model, state, tokens) -> str | None:
    """None for the cases the C step covers; otherwise the reason (the caller falls back)."""
    if tokens.device.type != "cpu":
        return f"the native step runs on the CPU, not {tokens.device.type}"
    if state.path not in ("softmax", "linear", "window", "hybrid"):
        return f"the native step runs softmax, linear, window and hybrid states, not {state.path}"
    dtype = model.embed_tokens.weight.dtype
    if dtype not in FLOAT_TYPES:
        return f"the native step reads fp32, f16 or bf16 weights, not {str(dtype).removeprefix('torch.')}"
    missing = sorted(block_kinds(model) - set(TYPES))
    if missing:
        return f"the native step has no kernels for {', '.join(missing)} blocks; the torch step runs them"
    kv, lin = state_parts(state)
    if lin is not None:
        if lin.S.dtype != torch.float32 or lin.z.dtype != torch.float32:
            return "the native step needs an fp32 linear state"
        if getattr(lin, "sparse_keys", 0):
            if lin.rk.dtype not in FLOAT_TYPES:
                return f"the native step reads recent and cached keys in fp32, f16 or bf16, not {lin.rk.dtype}"
        elif lin.path == "window" and (lin.wk.dtype not in FLOAT_TYPES or lin.window < 1):
            return f"the native step reads a window of fp32, f16 or bf16 keys, not {lin.wk.dtype}"
        if lin.feature_map.name not in MODES:
            return f"the native step has no feature map {lin.feature_map.name!r}"
        if lin.feature_map.name == "hedgehog":
            maps = learned_maps(lin.feature_map)
            if model.config.head_dim > HEDGEHOG_MAX_D:
                return f"the native step's learned maps take heads of up to {HEDGEHOG_MAX_D}, not {model.config.head_dim}"
            if any(t.dtype not in FLOAT_TYPES or t.dtype != maps[0].dtype or t.device.type != "cpu"
                   or not t.is_contiguous() for t in maps):
                return "the native step needs the learned maps as contiguous CPU tensors of one float dtype"
    if kv is not None and getattr(kv, "softmax_window", 0):
        return (f"the native step has no sliding-window KV cache (a ring of {kv.softmax_window} slots, Mistral's "
                f"sliding_window); the torch step runs it")
    if kv is not None and any(t.dtype not in FLOAT_TYPES for t in kv.tensors()):
        return f"the native step reads an fp32, f16 or bf16 KV cache, not {kv.k.dtype}"
    kv_tensors = [] if kv is None else [kv.k, kv.v]
    if not all(t.is_contiguous() for t in state.tensors() if not any(t is u for u in kv_tensors)) or \
            (kv is not None and kv_rows(kv) is None):
        return "the native step needs a contiguous state"
    return None


def kv_rows(kv) -> int | None:
    """The rows a KV cache's memory holds: its batch, or more where k and v are the first rows of a
    cache with spare rows (KVState.concat(rows=)); None for any other layout."""
    L, B, Hkv, S, D = kv.k.shape
    inner = Hkv * S * D
    rows = kv.k.stride(0) // inner if L > 1 else B
    for t in (kv.k, kv.v):
        if t.stride()[1:] != (inner, S * D, D, 1) or (L > 1 and (t.stride(0) != rows * inner or rows < B)):
            return None
    return rows
