"""Softmax attention with a preallocated KV cache.

KVState.k, .v: (L, B, Hkv, S_max, D), allocated once in the model's dtype and written in
place. Scores are q.k / sqrt(D); a masked softmax gives future slots and pad slots weight
exactly 0 (boolean masks, so exp(-inf) = 0, no large-negative approximations).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import Span, State
from engine.errors import ContextFullError

# Decode (one query, no mask) from this many cached keys on uses two matmuls instead of SDPA:
# measured on the 2-core dev VM, 1 thread: SDPA's kernel wins below ~1k keys, the matmuls above (2x at 32k).
ONE_QUERY_MATMUL_FROM = 1024


@dataclass(eq=False)
class KVState(State):
    k: torch.Tensor = None          # (L, B, Hkv, S_max, D)
    v: torch.Tensor = None          # (L, B, Hkv, S_max, D)
    slot_real: torch.Tensor = None  # (B, S_max) bool, False at pad slots

    path = "softmax"

    @classmethod
    def allocate(cls, cfg, batch: int, max_len: int, device, dtype, **_) -> "KVState":
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(lengths=torch.zeros(batch, dtype=torch.long, device=device), slots=0,
                   k=torch.zeros(shape, device=device, dtype=dtype),
                   v=torch.zeros(shape, device=device, dtype=dtype),
                   slot_real=torch.ones(batch, max_len, dtype=torch.bool, device=device))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def tensors(self):
        return [self.k, self.v]

    def open(self, tokens, real=None) -> Span:
        self._check(tokens, real)
        T, start = tokens.shape[1], self.slots
        if start + T > self.max_len:
            raise ContextFullError(
                f"KV cache full: {start} tokens held + {T} new > max_len {self.max_len}; "
                f"allocate a larger state (init_state(max_len=...)) or shorten the input")
        span = super().open(tokens, real)
        if span.real is not None:
            self.slot_real[:, start:start + T] = span.real
        if self.padded or (T > 1 and start > 0):
            # query slot start+i sees key slot j iff j <= start+i and the key is real;
            # it always sees itself, so a pad query's row is never all-masked (no NaN).
            q_slot = torch.arange(start, start + T, device=self.device)[:, None]
            k_slot = torch.arange(start + T, device=self.device)[None, :]
            causal = k_slot <= q_slot                                     # (T, S)
            keys = self.slot_real[:, None, None, :start + T]              # (B, 1, 1, S)
            span.attn_mask = (causal & keys) | (k_slot == q_slot)         # (B, 1, T, S)
        return span

    def __post_init__(self):
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))   # per-layer views, made once
        self._scale = torch.tensor(self.k.shape[-1] ** -0.5, device=self.k.device)

    def attend(self, layer: int, q, k, v, span: Span):
        """q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, D)."""
        start, T = span.start, span.length
        cache_k, cache_v = self._layers[layer]                  # (B, Hkv, S_max, D)
        cache_k.narrow(2, start, T).copy_(k)
        cache_v.narrow(2, start, T).copy_(v)
        keys, values = cache_k.narrow(2, 0, start + T), cache_v.narrow(2, 0, start + T)
        if T == 1 and span.attn_mask is None and start >= ONE_QUERY_MATMUL_FROM:
            return one_query_attention(q, keys, values, self._scale)
        causal = span.attn_mask is None and T > 1   # prefill from empty, no pads
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=span.attn_mask,
                                              is_causal=causal, enable_gqa=True)


def one_query_attention(q, keys, values, scale):
    """Decode attention for one query per sequence: two matmuls and a softmax, no mask needed.

    q (B, H, 1, D); keys, values (B, Hkv, S, D), views of the cache (no copy); scale a 0-dim
    tensor 1/sqrt(D). Query head h reads kv head h // G, as enable_gqa does. Softmax in fp32.
    For one query over many keys this beats SDPA's blocked kernel (see ONE_QUERY_MATMUL_FROM).
    """
    B, H, _, D = q.shape
    Hkv = keys.shape[1]
    scores = (q * scale).view(B, Hkv, H // Hkv, D) @ keys.transpose(-1, -2)      # (B, Hkv, G, S)
    if scores.dtype == torch.float32:
        probs = torch.softmax(scores, -1)
    else:
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
    return (probs @ values).view(B, H, 1, D)


def softmax_attention(q, k, v, valid=None):
    """Stateless causal attention over a whole sequence (training and full forward).

    q (B, H, T, D); k, v (B, Hkv, T, D); valid (B, T) bool or None.
    """
    if valid is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    T = q.shape[2]
    idx = torch.arange(T, device=q.device)
    mask = ((idx[None, :] <= idx[:, None]) & valid[:, None, None, :]) | (idx[None, :] == idx[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def softmax_attention_reference(q, k, v, valid=None):
    """Plain-torch twin of `softmax_attention`: explicit scores, mask, softmax, weighted sum."""
    B, H, T, D = q.shape
    groups = H // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)                  # (B, H, T, T)
    idx = torch.arange(T, device=q.device)
    allowed = (idx[None, :] <= idx[:, None]).expand(B, 1, T, T)
    if valid is not None:
        allowed = (allowed & valid[:, None, None, :]) | (idx[None, :] == idx[:, None])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
