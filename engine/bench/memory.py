"""Memory bookkeeping for the bench: state bytes by formula, what a run needs, what the machine has.

State bytes (batch B; the formulas the bench checks against the state's own tensors):

    KV cache      2 · L · B · Hkv · D · T · bytes(dtype)      T = slots the cache holds
    linear state  L · B · Hkv · (F · Dv + F) · 4               S (F x Dv) and z (F), fp32
    hybrid/window per layer (engine.attention.hybrid.state_bytes): a softmax layer holds its
                  KV cache (2 · B · Hkv · D · T · bytes), a linear one S and z (B · Hkv · (F · Dv + F) · 4)
                  plus, with a window W, the W newest keys and values (2 · B · Hkv · W · D · bytes)

With grouped-query attention the linear state is kept per key/value head (shared by the
query heads of its group, like the KV cache), so the "H" of the linear formula is
num_key_value_heads. F = feature_map.out_dim(head_dim); Dv = head_dim.
"""
from __future__ import annotations

import resource

import torch

from engine.attention.feature_maps import get_feature_map, state_dtype
from engine.attention.hybrid import state_bytes as per_layer_state_bytes
from engine.bench.configs import layer_paths
from engine.errors import EngineError


class DepthTooLargeError(EngineError, ValueError):
    """A requested context depth needs more memory than this machine has available."""


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes(cfg, slots: int, dtype: torch.dtype, batch: int = 1) -> int:
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * cfg.head_dim * slots * dtype_bytes(dtype)


def linear_state_bytes(cfg, feature_map: str | None, dtype: torch.dtype, batch: int = 1) -> int:
    F_ = get_feature_map(feature_map or cfg.feature_map).out_dim(cfg.head_dim)
    Dv = cfg.head_dim
    return cfg.num_hidden_layers * batch * cfg.num_key_value_heads * (F_ * Dv + F_) * dtype_bytes(state_dtype(dtype))


def state_bytes_formula(cfg, attention: str, slots: int, dtype: torch.dtype, feature_map: str | None = None,
                        batch: int = 1) -> int:
    if attention == "softmax":
        return kv_cache_bytes(cfg, slots, dtype, batch)
    return linear_state_bytes(cfg, feature_map, dtype, batch)


def config_state_bytes(rt, slots: int, dtype: torch.dtype, feature_map: str | None = None, batch: int = 1,
                       kv_dtype: torch.dtype | None = None) -> int:
    """State bytes of a runtime config `rt` (any attention, window or not) with a KV cache of `slots`
    (in `kv_dtype`, default `dtype`)."""
    if rt.attention in ("softmax", "linear") and not rt.window:
        cache = (kv_dtype or dtype) if rt.attention == "softmax" else dtype
        return state_bytes_formula(rt, rt.attention, slots, cache, feature_map, batch)
    F_ = get_feature_map(feature_map or rt.feature_map).out_dim(rt.head_dim)
    window = rt.window if rt.attention != "softmax" else 0
    return per_layer_state_bytes(rt, layer_paths(rt), slots, batch, dtype_bytes(dtype), F_, window,
                                 dtype_bytes(kv_dtype or dtype), sparse_keys=rt.sparse_keys if window else 0)


def prefill_work_bytes(cfg, attention: str, tokens: int, dtype: torch.dtype, feature_map: str | None = None) -> int:
    """A generous bound on the activations one prefill block of `tokens` keeps alive at once.

    Residual stream and norms (a few (T, C)), the fused qkv and rotated q, k, the gate/up
    projection (T, 2I) and its product, and for linear attention the fp32 feature maps and
    chunk outputs. Softmax prefill runs SDPA's flash kernel, which never builds (T, T).
    """
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    per_token = 8 * C + 3 * (H + 2 * Hkv) * D + 4 * I
    elt = max(dtype_bytes(dtype), 4)
    work = tokens * per_token * elt
    if attention != "softmax":
        F_ = get_feature_map(feature_map or cfg.feature_map).out_dim(D)
        work += tokens * 4 * (3 * (H + Hkv) * F_ + 3 * H * D)
    return work


def run_bytes(cfg, attention: str, context: int, slots: int, dtype: torch.dtype, weight_bytes: int,
              feature_map: str | None = None, batch: int = 1) -> dict[str, int]:
    """What one (attention, context) configuration needs: weights, state, prefill activations.

    `cfg` may be a configuration's runtime config (then its hybrid layers and window count). The state
    and the prefill activations are per sequence: `batch` sequences (prefilled as one block) need
    `batch` times them; the weights are shared."""
    rt = cfg if cfg.attention == attention else cfg.replace(attention=attention, layer_attention=None, window=0)
    parts = {"weights": weight_bytes,
             "state": config_state_bytes(rt, slots, dtype, feature_map, batch),
             "prefill": batch * prefill_work_bytes(cfg, attention, context, dtype, feature_map)}
    parts["total"] = sum(parts.values())
    return parts


def _kib_field(path: str, key: str) -> int | None:
    """A "Key:  N kB" line of a /proc file (meminfo, status) in bytes, or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None."""
    return _kib_field("/proc/meminfo", "MemAvailable")


def total_bytes() -> int | None:
    return _kib_field("/proc/meminfo", "MemTotal")


def _status_bytes(key: str) -> int | None:
    return _kib_field("/proc/self/status", key)


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM, else getrusage's ru_maxrss (KiB on Linux)."""
    hwm = _status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int | None:
    return _status_bytes("VmRSS")


def human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_fits(needs: list[tuple[str, int, dict[str, int]]], available: int | None = None,
               headroom: float = 0.9, batch: int = 1) -> None:
    """Refuse, before anything runs, every configuration that needs more than `headroom` of
    MemAvailable. needs: (label, context, run_bytes(...)) per configuration; batch: the batch they were
    counted for (named in the refusal, whose remedy may then be a smaller batch)."""
    available = available_bytes() if available is None else available
    if available is None:
        return
    limit = int(available * headroom)
    too_big = [(label, ctx, parts) for label, ctx, parts in needs if parts["total"] > limit]
    if too_big:
        label, ctx, parts = max(too_big, key=lambda t: t[2]["total"])
        depths = sorted({ctx for _, ctx, _ in too_big})
        at_batch, or_batch = (f" at batch {batch}", " or lower --batch") if batch > 1 else ("", "")
        raise DepthTooLargeError(
            f"context {ctx} ({label}){at_batch} needs {parts['total']} bytes ({human(parts['total'])}: state "
            f"{human(parts['state'])}, weights {human(parts['weights'])}, prefill activations "
            f"{human(parts['prefill'])}) but this machine has {available} bytes ({human(available)}) "
            f"available (MemAvailable, /proc/meminfo); drop depth(s) {', '.join(map(str, depths))} from --contexts"
            f"{or_batch}")

