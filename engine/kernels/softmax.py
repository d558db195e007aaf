"""Decode attention (one query a row) over a preallocated KV cache: split-K flash decoding in Triton,
and its plain-torch form.

Graph-capturable: the lengths are read from a device tensor, the number of splits depends only on
the shapes, and nothing waits on the device. Query head h reads kv head h // G (grouped-query
attention); the softmax is accumulated in fp32.
"""
from __future__ import annotations

import functools

import torch

from engine.kernels import backend

BLOCK_N = 64             # keys a tile
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 128


def why_not(q, cache_k, cache_v) -> str | None:
    """None when `softmax_decode` runs the kernel on these tensors; else why it runs the torch form."""
    reason = backend.why_not(q, cache_k, cache_v)
    if reason is None and cache_k.dtype != cache_v.dtype:
        reason = "keys and values of different dtypes"
    return reason


def softmax_decode(q, cache_k, cache_v, n_keys=None, key_real=None, scale=None):
    """softmax(q k^T * scale) v for one query a row over the first n_keys[b] keys of each row.

    q (B, H, 1, D); cache_k, cache_v (B, Hkv, N, D), any strides (views of the cache); n_keys (B,)
    int64 on q's device, or None: all N keys; key_real (B, N) bool or None (False: a pad key, weight
    0); scale a float or a 0-dim tensor on q's device (default D ** -0.5) -> (B, H, 1, D) in q's
    dtype. A row with no key gets 0. The torch form runs where `why_not` gives a reason.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if why_not(q, cache_k, cache_v) is not None:
        return softmax_decode_torch(q, cache_k, cache_v, n_keys, key_real, scale)
    return _launch(q, cache_k, cache_v, n_keys, key_real, scale)


def softmax_decode_torch(q, cache_k, cache_v, n_keys=None, key_real=None, scale=None):
    """The plain-torch form of `softmax_decode` (same arguments): masked scores over the whole cache,
    softmax in fp32, in the cache's dtype otherwise (as `one_query_attention`)."""
    B, H, _, D = q.shape
    Hkv, N = cache_k.shape[1], cache_k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    keys, values = cache_k, cache_v
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    scores = (q * scale).view(B, Hkv, H // Hkv, D) @ keys.transpose(-1, -2)      # (B, Hkv, G, N)
    keep = None
    if n_keys is not None:
        keep = torch.arange(N, device=q.device) < n_keys[:, None]                # (B, N)
    if key_real is not None:
        keep = key_real if keep is None else keep & key_real
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32)
    if keep is not None:   # a row with no key: 0, not NaN
        probs = probs.masked_fill(~keep.any(1)[:, None, None, None], 0.0)
    return (probs.to(values.dtype) @ values).view(B, H, 1, D)


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Programs enough to keep every SM streaming (4 a SM); 4 under the interpreter."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(N: int, rows: int, device) -> tuple[int, int]:
    """(splits, keys a split) for a cache of N slots and rows = B * Hkv: a function of the shapes
    alone, so a captured graph replays it at any length. Keys a split is a power of two (a constant
    of the compiled kernel: a handful of variants as N grows)."""
    import triton
    splits = max(1, min(triton.cdiv(N, MIN_KEYS_PER_SPLIT), triton.cdiv(_programs_wanted(device), rows), MAX_SPLITS))
    per = max(BLOCK_N, triton.next_power_of_2(triton.cdiv(N, splits)))
    return triton.cdiv(N, per), per


def _launch(q, cache_k, cache_v, n_keys, key_real, scale):
    import triton
    B, H, _, D = q.shape
    Hkv, N = cache_k.shape[1], cache_k.shape[2]
    G = H // Hkv
    splits, per = splits_for(N, B * Hkv, q.device)
    m = torch.empty(B * Hkv, splits, G, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B * Hkv, splits, G, D, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, 1, D, device=q.device, dtype=q.dtype)
    q3 = q[:, :, 0]
    scale_is_tensor = isinstance(scale, torch.Tensor)
    # fp32 products for fp32 or mixed inputs, and under the interpreter, whose tl.dot multiplies
    # bfloat16's raw bits (Triton 3.6); 16-bit tensor-core products with fp32 sums on the GPU
    fp32_dot = q.dtype == torch.float32 or q.dtype != cache_k.dtype or backend.interpreting()
    BLOCK_D = max(16, triton.next_power_of_2(D))            # tl.dot takes no side under 16
    backend.kernel("softmax_triton", "softmax_split_kernel")[(B * Hkv, splits)](
        q3, cache_k, cache_v, n_keys if n_keys is not None else q3,
        key_real.view(torch.uint8) if key_real is not None else q3,   # bytes, read as != 0
        scale if scale_is_tensor else q3, 1.0 if scale_is_tensor else float(scale),
        m, l, acc, Hkv, G, N, D, *q3.stride(), *cache_k.stride(), *cache_v.stride(),
        *(key_real.stride() if key_real is not None else (0, 0)),
        HAS_N=n_keys is not None, HAS_REAL=key_real is not None, SCALE_PTR=scale_is_tensor, FP32_DOT=fp32_dot,
        INTERPRET=backend.interpreting(),
        KEYS_PER_SPLIT=per, GB=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    o3 = out[:, :, 0]
    backend.kernel("softmax_triton", "softmax_combine_kernel")[(B * H,)](
        m, l, acc, o3, H, G, D, splits, *o3.stride(),
        BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=BLOCK_D)
    return out
