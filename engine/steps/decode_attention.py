"""Softmax decode attention over a fixed-length view of the KV cache: one query per row, shapes that do
not move from token to token, so a captured CUDA graph replays it (engine.steps.graph_step).

    out = softmax_decode(q, cache_k, cache_v, n_keys, key_real, scale)

The one call site is `engine.steps.graph_step.kv_attend_static`. On CUDA with triton it runs the
split-K Triton kernel (engine.kernels.softmax_decode); elsewhere the plain-torch body below.
"""
from __future__ import annotations

import torch

from engine.kernels import softmax as kernel


def softmax_decode(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, n_keys: torch.Tensor,
                   key_real: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    """q (B, H, 1, D); cache_k, cache_v (B, Hkv, N, D): the first N slots of the cache (views with the
    full cache's strides, not contiguous); n_keys (B,) int64 on q's device, contiguous: row b reads keys
    [0, n_keys[b]); key_real (B, N) bool (a view of the state's slot_real) or None (every key real);
    scale: 0-dim fp32 tensor (1/sqrt(D)) on q's device.

    Key j of row b is seen iff j < n_keys[b] and (key_real[b, j] or j == n_keys[b] - 1): the query's
    own key (the last one read) always, so no row is all-masked. Query head h reads kv head h // G
    (G = H / Hkv), as enable_gqa does. Scores and values in q's dtype (a cache of another dtype is read
    widened to it), softmax in fp32. Returns (B, H, 1, D) in q's dtype. No host syncs.
    """
    if kernel.why_not(q, cache_k, cache_v) is None:   # (under torch.compile: no, the torch body is traced)
        # split-K flash decoding (engine.kernels.softmax): reads only each row's n_keys keys. Its key_real
        # has no own-key exception; none is needed: a slot not yet written is always real in slot_real
        # (pads are only ever written below `slots`), and the query's own slot is the one being written.
        return kernel.softmax_decode(q, cache_k, cache_v, n_keys, key_real, scale)
    B, H, _, D = q.shape
    Hkv, N = cache_k.shape[1], cache_k.shape[2]
    if cache_k.dtype != q.dtype:    # a 16-bit cache under fp32 weights (kv_dtype)
        cache_k, cache_v = cache_k.to(q.dtype), cache_v.to(q.dtype)
    j = torch.arange(N, device=q.device)[None, :]                               # (1, N)
    last = n_keys[:, None] - 1                                                  # (B, 1)
    seen = j <= last
    if key_real is not None:
        seen = seen & (key_real | (j == last))
    scores = (q * scale).view(B, Hkv, H // Hkv, D) @ cache_k.transpose(-1, -2)   # (B, Hkv, G, N)
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32)
    return (probs.to(q.dtype) @ cache_v).view(B, H, 1, D)
