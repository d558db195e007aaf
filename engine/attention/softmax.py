"""Softmax attention with a preallocated KV cache.

KVState.k, .v: (L, B, Hkv, S_max, D), allocated once in the model's dtype and written in
place. Scores are q.k / sqrt(D); a masked softmax gives future slots and pad slots weight
exactly 0 (boolean masks, so exp(-inf) = 0, no large-negative approximations).

Slots left unwritten. A cache allocated on the CPU is not zeroed (the pages of a large allocation
stay untouched, so not resident, until a token is written there: a 32k-slot cache costs what it
holds), and a batch laid out from other states on the CPU (`concat`, `select_rows`: the server
joining a row, dropping one) copies each row's slots from its first real one and writes nothing
else: a 4k-token prompt joining 16 short rows right-aligns them to its length, and zeroing their ~4k
leading pad slots each was a 3.4 GB write (a ~1 s stall of every stream). The decode steps never
read a pad (the torch step attends from each row's first real slot, the native step skips pads),
nor a slot past `slots`. The readers that do zero them first: a masked block (T > 1 on a padded
state) the pads among the slots written (`pads_unset`), the static step form, which reads a whole
bucket of slots under a mask, those and the slots past `slots` (`unset`); saving writes zeros for
pads. On other devices every slot is zeroed as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import Span, State, take_rows
from engine.errors import ContextFullError

# Decode (one query, no mask) from this many cached keys on uses two matmuls instead of SDPA:
# measured on the 2-core dev VM, 1 thread: SDPA's kernel wins below ~1k keys, the matmuls above (2x at 32k).
ONE_QUERY_MATMUL_FROM = 1024


@dataclass(eq=False)
class KVState(State):
    k: torch.Tensor = None          # (L, B, Hkv, S_max, D)
    v: torch.Tensor = None          # (L, B, Hkv, S_max, D)
    slot_real: torch.Tensor = None  # (B, S_max) bool, False at pad slots
    unset: bool = False             # slots past `slots` may be unwritten memory (module docstring)
    pads_unset: bool = False        # so may pad slots among the written ones
    slab: tuple | None = None       # (k, v, slot_real, lengths) of a cache with spare rows and slots:
                                    # this state is its first B rows (`concat(rows=, headroom=)`)

    path = "softmax"
    slabs = True    # concat(rows=, headroom=) lays out a slab that rows join and leave in place

    @classmethod
    def allocate(cls, cfg, batch: int, max_len: int, device, dtype, **_) -> "KVState":
        return cls.allocate_shape(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim,
                                  device, dtype, zero=torch.device(device).type != "cpu")

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

    # ------------------------------------------------------------------ saving and batching
    def identity(self) -> dict:
        L, _, Hkv, _, D = self.k.shape
        return {"path": self.path, "layers": L, "kv_heads": Hkv, "head_dim": D,
                "dtype": str(self.k.dtype).removeprefix("torch.")}

    def _saved_tensors(self):
        n = self.slots
        k, v = self.k[:, :, :, :n], self.v[:, :, :, :n]
        if self.pads_unset:   # pads saved as zeros (copies; this state stays as it is)
            pad = ~self.slot_real[:, :n][None, :, None, :, None]
            k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
        return {"k": k, "v": v, "slot_real": self.slot_real[:, :n]}

    def _load_tensors(self, tensors, slots):
        self.k[:, :, :, :slots].copy_(tensors["k"])
        self.v[:, :, :, :slots].copy_(tensors["v"])
        self.slot_real.fill_(True)
        self.slot_real[:, :slots].copy_(tensors["slot_real"])

    def first_real_slot(self) -> torch.Tensor:
        """(B,) int64: each row's first real slot (= slots for a row with none)."""
        real = self.slot_real[:, :self.slots]
        if self.slots == 0:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        first = real.int().argmax(1)
        return torch.where(real.any(1), first, torch.full_like(first, self.slots))

    def _lead_pads(self) -> int:
        """The leading slots that are pads in every row."""
        return min(self.first_real_slot().tolist()) if self.batch_size and self.slots else 0

    def select_rows(self, idx, max_len=None) -> "KVState":
        # each row copied from its first real slot straight into an uninitialised cache; on the CPU
        # nothing else is written (module docstring), elsewhere the rest is zeroed
        idx = [int(i) for i in idx]
        first = self.first_real_slot().tolist()
        drop = min(first[i] for i in idx) if idx and self.slots else 0
        n = self.slots - drop
        max_len = max(max_len or self.max_len - drop, n)
        L, _, Hkv, _, D = self.k.shape
        out = KVState.allocate_shape(L, len(idx), Hkv, max_len, D, self.device, self.k.dtype, zero=False)
        for dst, src in enumerate(idx):
            out._put_row(dst, first[src] - drop, n, self, src, first[src])
        out.slot_real[:, :n] = take_rows(self.slot_real, idx, 0)[:, drop:self.slots]
        out.lengths.copy_(take_rows(self.lengths, idx, 0))
        out.slots = n
        out._after_regroup()
        out._laid_out(self.unset, self.pads_unset)
        return out

    @classmethod
    def concat(cls, states, max_len=None, rows: int = 0, headroom: int = 0) -> "KVState":
        """The states' rows in one batch, right-aligned to the longest (a row's leading slots pads).
        rows / headroom (CPU): a slab, where later rows join and leave in place (`join`, `keep_rows`)
        without moving the others: memory for `rows` rows, the rows aligned at slot >= `headroom`
        (so a prompt up to that long joins right-aligned), and room to decode `headroom` more steps
        than `max_len` asks. Untouched slots cost address space only (module docstring)."""
        cls.check_same_identity(states, "shapes or dtypes")
        n = sum(s.batch_size for s in states)
        P0 = max(s.slots for s in states)
        max_len = max(max_len or max(s.max_len for s in states), P0)
        slab = (rows > n or headroom > 0) and states[0].device.type == "cpu"
        # a slab drops the leading slots that are pads in every row of a state (a running slab's: its
        # rows never shift left in place, so under steady load its slots grow with every step)
        drops = [s._lead_pads() if slab else 0 for s in states]
        P = max([headroom] + [s.slots - d for s, d in zip(states, drops)]) if slab else P0
        if slab:
            max_len = P + max(max_len - P0, headroom)
        L, _, Hkv, _, D = states[0].k.shape
        out = cls.allocate_shape(L, max(n, rows) if slab else n, Hkv, max_len, D,
                                 states[0].device, states[0].k.dtype, zero=False)
        if slab and out.batch_size > n:
            out = out._slab_view(n, out)
        out._place(states, 0, P, drops)
        out._laid_out(any(s.unset for s in states), any(s.pads_unset for s in states))
        return out

    def _slab_view(self, n: int, base: "KVState | None" = None) -> "KVState":
        """A state over the first n rows of this slab's memory (base: a state holding all of it)."""
        k, v, real, lengths = self.slab if base is None else (base.k, base.v, base.slot_real, base.lengths)
        if base is None:
            lengths[:self.batch_size].copy_(self.lengths)     # a commit may have rebound lengths
        out = KVState(lengths=lengths[:n], slots=self.slots if base is None else 0, k=k[:, :n], v=v[:, :n],
                      slot_real=real[:n], slab=(k, v, real, lengths))
        out.padded, out.unset, out.pads_unset = self.padded, self.unset, self.pads_unset
        return out

    def join(self, states, max_len) -> "KVState | None":
        """This batch and the states' rows, the new rows written into this slab's spare rows (nothing
        of this batch's rows is moved): a new state over the same memory, or None where they do not
        fit (no slab, too few spare rows, a state longer than this batch's slots, or fewer spare
        slots than `max_len` - the longest row's slots asks)."""
        if self.slab is None or not states:
            return None
        self.check_same_identity([self] + list(states), "shapes or dtypes")
        n, P = self.batch_size, self.slots
        m = n + sum(s.batch_size for s in states)
        longest = max([P] + [s.slots for s in states])
        if m > self.slab[0].shape[1] or longest > P or P + max_len - longest > self.max_len:
            return None
        out = self._slab_view(m)
        out._place(states, n, P)
        out._laid_out(self.unset or any(s.unset for s in states),
                      self.pads_unset or any(s.pads_unset for s in states))
        return out

    def keep_rows(self, keep: list[int]) -> tuple["KVState", list[int]] | None:
        """Rows `keep` of this slab in place: each dropped row's place among the first len(keep)
        rows is taken by a kept row from beyond them (one row's real slots copied; the rest do not
        move). Returns (the new state, the old row index of each of its rows), or None for no slab."""
        if self.slab is None:
            return None
        keep = sorted(int(i) for i in keep)
        m = len(keep)
        order = list(range(m))
        kept = set(keep)
        holes = [i for i in range(m) if i not in kept]
        movers = [i for i in keep if i >= m]
        out = self._slab_view(m)
        first = self.first_real_slot().tolist()
        P = self.slots
        for hole, src in zip(holes, movers):
            f = first[src]
            for t in (out.slab[0], out.slab[1]):
                t[:, hole, :, f:P] = t[:, src, :, f:P]
            out.slot_real[hole, :P] = self.slot_real[src, :P]
            out.lengths[hole] = self.lengths[src]
            order[hole] = src
        out._after_regroup()
        return out, order

    def _place(self, states, b: int, P: int, drops=None, copy: bool = True) -> None:
        """The states' rows into rows b.. of this batch, right-aligned to slot P (sets slots = P), each
        state's first drops[i] slots (pads in each of its rows: `_lead_pads`) left out. copy=False:
        their keys and values are there already (`stage`), only the bookkeeping is set."""
        for s, drop in zip(states, drops or [0] * len(states)):
            rows, lo = slice(b, b + s.batch_size), P - (s.slots - drop)   # right-align: pads in [0, lo)
            for r, f in enumerate(s.first_real_slot().tolist() if copy else []):
                self._put_row(b + r, lo + f - drop, P, s, r, f)
            self.slot_real[rows, :lo] = False
            self.slot_real[rows, lo:P] = s.slot_real[:, drop:s.slots]
            self.lengths[rows] = s.lengths
            b += s.batch_size
        self.slots = P
        self._after_regroup()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values, every layer."""
        L, _, Hkv, _, D = self.k.shape
        return 2 * L * Hkv * D * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held. A slab's rows: their real slots only (its spare rows,
        pads and room are address space no page of which was written: not resident)."""
        if self.slab is None:
            return super().nbytes
        return self.token_bytes * int(self.lengths.sum())

    def row_bytes(self) -> int:
        """Bytes of one row's real keys and values, every layer (the most it holds; what a copy of it writes)."""
        return self.token_bytes * int(self.lengths.max()) if self.batch_size else 0

    def stage(self, state: "KVState", slot: int, layers: range) -> bool:
        """Copy `layers` of batch-1 `state`'s row into this slab's next spare row (row B), its real
        slots ending at `slot`: a long row joins over several steps, a few layers a step (issue 29;
        `join_staged` ends it). False (nothing written) where it cannot: no slab, no spare row, or
        `slot` before the state's slots or past this slab's."""
        row = self.batch_size
        if (self.slab is None or state.batch_size != 1 or row >= self.slab[0].shape[1]
                or not state.slots <= slot <= self.max_len or state.identity() != self.identity()):
            return False
        f = int(state.first_real_slot()[0])
        at = slot - state.slots + f
        for mine, theirs in zip(self.slab[:2], (state.k, state.v)):
            mine[layers.start:layers.stop, row, :, at:slot] = theirs[layers.start:layers.stop, 0, :, f:state.slots]
        return True

    def join_staged(self, state: "KVState") -> "KVState":
        """This batch and `state`'s row, every layer of which `stage` copied (at slot == self.slots)."""
        out = self._slab_view(self.batch_size + 1)
        out._place([state], self.batch_size, self.slots, copy=False)
        out._laid_out(self.unset or state.unset, True)
        return out

    def _put_row(self, row: int, at: int, end: int, src: "KVState", src_row: int, src_from: int) -> None:
        """Row `row`'s slots [at, end) <- src's row `src_row` from slot `src_from` (its real slots on);
        off the CPU the row's other slots are zeroed (module docstring)."""
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            mine[:, row, :, at:end] = theirs[:, src_row, :, src_from:src_from + end - at]
            if self.device.type != "cpu":
                mine[:, row, :, :at].zero_()
                mine[:, row, :, end:].zero_()

    def _laid_out(self, unset: bool, pads_unset: bool) -> None:
        """After concat / select_rows: which slots may hold unwritten memory (module docstring)."""
        cpu = self.device.type == "cpu"
        self.unset, self.pads_unset = unset or cpu, self.padded and (pads_unset or cpu)

    def zero_pads(self) -> None:
        """Zero the pad slots among the slots written where they may be unwritten, for a reader that
        weighs them by 0 (0 * NaN is NaN). A flag test when there is nothing to do."""
        if not self.pads_unset:
            return
        n = self.slots
        pad = ~self.slot_real[:, :n][None, :, None, :, None]
        for t in (self.k, self.v):
            t[:, :, :, :n].masked_fill_(pad, 0)
        self.pads_unset = False

    def zero_unwritten(self) -> None:
        """zero_pads, and zero the slots past `slots` where they may be unwritten (for a reader of a
        whole bucket of slots under a mask)."""
        self.zero_pads()
        if self.unset:
            for t in (self.k, self.v):
                t[:, :, :, self.slots:].zero_()
            self.unset = False

    @classmethod
    def allocate_shape(cls, layers, batch, kv_heads, max_len, head_dim, device, dtype, zero=True) -> "KVState":
        """zero=False: k and v uninitialised (`unset`: the module docstring says who may read them)."""
        shape = (layers, batch, kv_heads, max_len, head_dim)
        make = torch.zeros if zero else torch.empty
        return cls(lengths=torch.zeros(batch, dtype=torch.long, device=device), slots=0,
                   k=make(shape, device=device, dtype=dtype),
                   v=make(shape, device=device, dtype=dtype),
                   slot_real=torch.ones(batch, max_len, dtype=torch.bool, device=device), unset=not zero)

    @classmethod
    def from_state_dict(cls, sd, max_len: int | None = None, device=None, feature_map=None) -> "KVState":
        """A new state from `state_dict()` output, with capacity `max_len` (default: the slots saved). A
        sliding-window state's (its identity names the window) loads through SlidingKVState instead
        (engine.attention.hybrid.saved_state_class picks the class). feature_map: taken as every state's
        from_state_dict takes it, and ignored (softmax has none)."""
        k = sd["tensors"]["k"]
        L, B, Hkv, n, D = k.shape
        out = cls.allocate_shape(L, B, Hkv, max(max_len or n, n), D, device or k.device, k.dtype)
        out.load_state_dict(sd)
        return out

    def attend(self, layer: int, q, k, v, span: Span):
        """q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, D)."""
        start, T = span.start, span.length
        if T > 1 or (span.attn_mask is not None and span.real is not None):
            self.zero_pads()         # a masked block reads every slot it holds (this block's: written first)
        cache_k, cache_v = self._layers[layer]                  # (B, Hkv, S_max, D)
        cache_k.narrow(2, start, T).copy_(k)
        cache_v.narrow(2, start, T).copy_(v)
        keys, values = cache_k.narrow(2, 0, start + T), cache_v.narrow(2, 0, start + T)
        if keys.dtype != q.dtype:      # a 16-bit cache under fp32 weights (kv_dtype): read widened
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if T == 1 and span.attn_mask is None:
            return self._one_query(q, keys, values)
        if T == 1 and span.real is None:   # one token per row of a padded batch
            return self._rows_over_real_keys(q, keys, values)
        causal = span.attn_mask is None and T > 1   # prefill from empty, no pads
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=span.attn_mask,
                                              is_causal=causal, enable_gqa=True)

    def _one_query(self, q, keys, values):
        """One query per row, every key real: the decode attention of an unpadded batch. On CUDA, SDPA
        (its flash kernel needs no mask here): on an H100 it beat the split-K Triton kernel at every
        depth measured (benchmarks/gpu_kernels.py: 1 x 32k keys 0.065 ms against 0.18, 32 x 32k 0.70 against
        0.84; docs/measurements.md), which serves the captured step (engine.steps.decode_attention), where
        the row lengths live on the device and a mask over the whole bucket would cost the bucket's bytes."""
        if q.is_cuda:
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        if keys.shape[2] > ONE_QUERY_MATMUL_FROM:
            return one_query_attention(q, keys, values, self._scale)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    def _rows_over_real_keys(self, q, keys, values):
        """Decode attention of a padded batch, each row over its real keys only, as it runs alone.

        A mask would give the pads weight 0 but still move the row's sums (a masked kernel is not the
        unmasked one; an f16 model's logits moved by ~1e-2): rows are grouped by their first real
        slot and each group attends, unmasked, to the slots from there on (a row with pads between
        real slots to a copy of its real keys), so a row's numbers do not depend on its neighbours."""
        n = keys.shape[2]
        real = self.slot_real[:, :n].clone()
        real[:, n - 1] = True                                        # a query always sees itself
        first = real.int().argmax(1)
        packed = (real.sum(1) != n - first).tolist()                 # pads after the first real slot
        groups: dict = {}
        for b, (t0, gaps) in enumerate(zip(first.tolist(), packed)):
            groups.setdefault(-1 - b if gaps else t0, []).append(b)
        out = torch.empty_like(q)
        for key, rows in groups.items():
            at = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else rows
            if key < 0:   # one row (a slice): a view of it, then a copy of its real slots
                slots = real[rows[0]].nonzero()[:, 0]
                k, v = keys[at][:, :, slots], values[at][:, :, slots]
            else:         # the slots first (a view), then the rows: a copy of their real slots only, not
                k, v = keys[:, :, key:][at], values[:, :, key:][at]   # the pads (a slab's thousands)
            out[at] = self._one_query(q[at], k, v)
        return out


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
