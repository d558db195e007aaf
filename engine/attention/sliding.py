"""Sliding-window softmax attention (Mistral's `sliding_window`): a ring KV cache of W slots per layer.

Query t sees keys (t - W, t], its own included: at most W keys, as transformers' mask does
(`sliding_window_overlay`: kv_idx > q_idx - sliding_window, on top of the causal mask). The window is the
checkpoint's (`ModelConfig.softmax_window`, "sliding window" in messages), named apart from the linear
path's `window` (engine.attention.window: linear attention + the exact last W keys).

SlidingKVState.k, .v: (L, B, Hkv, W, D); slot s (counted as KVState counts them, pads included) lives at
ring index s % W, so the state holds W slots whatever the context (`nbytes` is O(W)) and has no capacity
(`max_len` None). ring_real (B, W): the index holds a real key (False: a pad, or never written).

A block of T tokens: its queries attend over [the ring as it was before the block] + [the block's own
keys], with the band mask, in chunks of queries (each chunk reads the ring only while some query of it can
still see a key there, and the block keys inside its band); then the block's last min(T, W) keys are
written into the ring. Windows count slots: pads come only first (left-padded prompt blocks), so a row's
last W slots hold its last W real keys, or all of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import Span, State, take_rows
from engine.attention.softmax import ONE_QUERY_MATMUL_FROM, one_query_attention

QUERY_CHUNK = 256   # queries per attention call in a long block: masks of QUERY_CHUNK x (W + QUERY_CHUNK + W)


@dataclass
class SlidingSpan(Span):
    write: torch.Tensor = None                          # (n,) ring indices of the block's last n = min(T, W) keys
    blocks: list = field(default_factory=list)          # T > 1: (s, e, lo, ring, mask) per chunk of queries


@dataclass(eq=False)
class SlidingKVState(State):
    k: torch.Tensor = None          # (L, B, Hkv, W, D)
    v: torch.Tensor = None          # (L, B, Hkv, W, D)
    ring_real: torch.Tensor = None  # (B, W) bool

    path = "softmax"                # a softmax layer's state (rotary, adapters, paths): its window is its own

    @classmethod
    def allocate(cls, cfg, batch: int, max_len, device, dtype, **_) -> "SlidingKVState":
        """A ring of cfg.softmax_window slots per layer (`max_len` is ignored: the state does not grow)."""
        return cls.allocate_shape(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.softmax_window,
                                  cfg.head_dim, device, dtype)

    @classmethod
    def allocate_shape(cls, layers, batch, kv_heads, window, head_dim, device, dtype) -> "SlidingKVState":
        shape = (layers, batch, kv_heads, window, head_dim)
        return cls(lengths=torch.zeros(batch, dtype=torch.long, device=device), slots=0,
                   k=torch.zeros(shape, device=device, dtype=dtype), v=torch.zeros(shape, device=device, dtype=dtype),
                   ring_real=torch.zeros(batch, window, dtype=torch.bool, device=device))

    def __post_init__(self):
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))

    @property
    def softmax_window(self) -> int:
        return self.k.shape[3]

    def tensors(self):
        return [self.k, self.v]

    # ------------------------------------------------------------------ the protocol
    def open(self, tokens, real=None) -> SlidingSpan:
        base = super().open(tokens, real)
        span = SlidingSpan(base.start, base.length, base.positions, base.real)
        T, start, W, dev = span.length, span.start, self.softmax_window, self.device
        n = min(T, W)
        span.write = torch.arange(start + T - n, start + T, device=dev) % W
        if T > 1:
            span.blocks = self._blocks(span)
        self.ring_real[:, span.write] = True if span.real is None else span.real[:, T - n:]
        if T == 1 and self.padded:     # a row sees the real keys of its ring, its own always (no NaN)
            own = torch.zeros(W, dtype=torch.bool, device=dev)
            own[start % W] = True
            span.attn_mask = (self.ring_real | own)[:, None, None, :]             # (B, 1, 1, W)
        return span

    def _blocks(self, span: SlidingSpan) -> list:
        """Per chunk [s, e) of the block's queries: (s, e, lo, ring, mask): keys [ring (W) if ring] + the
        block's [lo, e), mask (B, 1, e - s, keys) True = attend, from the ring as it is before the block."""
        T, start, W, dev = span.length, span.start, self.softmax_window, self.device
        B = self.batch_size
        real = span.real if span.real is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
        r = torch.arange(W, device=dev)
        held = start - 1 - torch.remainder(start - 1 - r, W)           # the slot ring index r holds now (< 0: none)
        out = []
        for s in range(0, T, QUERY_CHUNK):
            e = min(s + QUERY_CHUNK, T)
            t = torch.arange(s, e, device=dev)[:, None]                 # (C, 1) query offsets in the block
            lo = max(0, s - W + 1)
            u = torch.arange(lo, e, device=dev)[None, :]                # (1, K) block key offsets
            band = (u <= t) & (u > t - W)
            allowed = (band & real[:, None, lo:e]) | (u == t)           # (B, C, K): its own key always
            ring = start > 0 and s <= W - 2                             # query t sees ring slots > start + t - W
            if ring:
                seen = (held[None, :] > start + t - W) & (held[None, :] >= 0)            # (C, W)
                allowed = torch.cat([seen & self.ring_real[:, None, :], allowed], 2)
            out.append((s, e, lo, ring, allowed[:, None]))
        return out

    def attend(self, layer: int, q, k, v, span: SlidingSpan):
        """q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, D)."""
        cache_k, cache_v = self._layers[layer]                          # (B, Hkv, W, D)
        T, n = span.length, span.write.shape[0]
        if T == 1:
            cache_k.index_copy_(2, span.write, k.to(cache_k.dtype))
            cache_v.index_copy_(2, span.write, v.to(cache_v.dtype))
            m = min(span.start + 1, self.softmax_window) if span.attn_mask is None else self.softmax_window
            keys, values = widened(cache_k.narrow(2, 0, m), q), widened(cache_v.narrow(2, 0, m), q)
            if span.attn_mask is None and not q.is_cuda and m >= ONE_QUERY_MATMUL_FROM:
                return one_query_attention(q, keys, values, q.new_tensor(q.shape[-1] ** -0.5))
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=span.attn_mask, enable_gqa=True)
        if k.dtype != cache_k.dtype:     # the block's keys as the ring will hold them (kv_dtype)
            k, v = k.to(cache_k.dtype), v.to(cache_v.dtype)
        outs = []
        for s, e, lo, ring, mask in span.blocks:
            keys, values = k[:, :, lo:e], v[:, :, lo:e]
            if ring:
                keys, values = torch.cat([cache_k, keys], 2), torch.cat([cache_v, values], 2)
            outs.append(F.scaled_dot_product_attention(q[:, :, s:e], widened(keys, q), widened(values, q),
                                                       attn_mask=mask, enable_gqa=True))
        cache_k.index_copy_(2, span.write, k[:, :, T - n:])
        cache_v.index_copy_(2, span.write, v[:, :, T - n:])
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    # ------------------------------------------------------------------ saving and batching
    def identity(self) -> dict:
        L, _, Hkv, W, D = self.k.shape
        return {"path": self.path, "layers": L, "kv_heads": Hkv, "head_dim": D, "softmax_window": W,
                "dtype": str(self.k.dtype).removeprefix("torch.")}

    def _saved_tensors(self):
        return {"k": self.k, "v": self.v, "ring_real": self.ring_real}

    def _load_tensors(self, tensors, slots):
        for name in ("k", "v", "ring_real"):
            getattr(self, name).copy_(tensors[name])

    def _shifted(self, slots: int, new_slots: int, k, v, ring_real) -> tuple:
        """Ring tensors renumbered from `slots` to `new_slots` (slot s becomes s + new_slots - slots)."""
        shift = new_slots - slots
        if shift % self.softmax_window:
            k, v, ring_real = k.roll(shift, 3), v.roll(shift, 3), ring_real.roll(shift, 1)
        return k, v, ring_real

    def _rows(self, lengths, slots, k, v, ring_real) -> "SlidingKVState":
        out = SlidingKVState(lengths=lengths, slots=slots, k=k, v=v, ring_real=ring_real)
        out._after_regroup()
        return out

    def select_rows(self, idx, max_len=None) -> "SlidingKVState":
        """Rows `idx`, copied; the slots that are pads in every kept row are dropped (the ring renumbered),
        so a row of a padded batch selected alone is the state it would have alone. `max_len` is ignored."""
        idx = [int(i) for i in idx]
        lengths = take_rows(self.lengths, idx, 0)
        slots = int(lengths.max()) if idx else 0      # every row's real keys are its last `lengths` slots
        k, v = take_rows(self.k, idx, 1), take_rows(self.v, idx, 1)
        return self._rows(lengths, slots, *self._shifted(self.slots, slots, k, v,
                                                         take_rows(self.ring_real, idx, 0)))

    @classmethod
    def concat(cls, states, max_len=None) -> "SlidingKVState":
        """Rows of `states` in order; each renumbered to the longest's slots (its older slots: pads)."""
        cls.check_same_identity(states, "shapes, sliding windows or dtypes")
        P = max(s.slots for s in states)
        parts = [s._shifted(s.slots, P, s.k, s.v, s.ring_real) for s in states]
        return states[0]._rows(torch.cat([s.lengths for s in states]), P,
                               torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1),
                               torch.cat([p[2] for p in parts]))

    @classmethod
    def from_state_dict(cls, sd, max_len: int | None = None, device=None, feature_map=None) -> "SlidingKVState":
        """A new state from `state_dict()` output (`max_len` and `feature_map` are ignored: the state does
        not grow, softmax has no map)."""
        k = sd["tensors"]["k"]
        L, B, Hkv, W, D = k.shape
        out = cls.allocate_shape(L, B, Hkv, W, D, device or k.device, k.dtype)
        out.load_state_dict(sd)
        return out


def widened(x, q):
    """A cache tensor read in q's dtype (a 16-bit cache under fp32 weights: kv_dtype)."""
    return x if x.dtype == q.dtype else x.to(q.dtype)


def sliding_part(state):
    """The state's sliding-window KV cache (the state itself or a hybrid's softmax part), or None."""
    for part in getattr(state, "parts", None) or [state]:
        if isinstance(part, SlidingKVState):
            return part
    return None


def band(T: int, window: int, device, valid=None) -> torch.Tensor:
    """(T, T) bool, or (B, 1, T, T) with `valid` (B, T) (False at pads): query i sees key j iff
    i - window < j <= i and j is real, and always its own key."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    inside = (j <= i) & (j > i - window)
    if valid is None:
        return inside
    return (inside & valid[:, None, None, :]) | (i == j)


def sliding_softmax_attention(q, k, v, window: int, valid=None):
    """Stateless sliding-window causal attention over whole sequences (training, full forward).

    q (B, H, T, D); k, v (B, Hkv, T, D); valid (B, T) bool or None."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band(q.shape[2], window, q.device, valid),
                                          enable_gqa=True)


def sliding_softmax_reference(q, k, v, window: int, valid=None):
    """Plain-torch twin of `sliding_softmax_attention`: explicit scores, band mask, softmax, weighted sum."""
    B, H, T, D = q.shape
    groups = H // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / D ** 0.5
    allowed = band(T, window, q.device, valid).expand(B, 1, T, T)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
