"""The state protocol both attention paths implement, declared once.

    state = KVState.allocate(cfg, batch, max_len, device, dtype)     # or LinearState.allocate(...)
    span = state.open(tokens, real)          # a block of T tokens: where it goes, who is real
    out = state.attend(layer, q, k, v, span) # per layer: write the block's keys/values, attend
    state.commit(span)                       # once per model step: advance the state's position

Layout convention for the whole code base: activations are (B, T, C); per-head tensors are
(B, H, T, D); caches and states carry a leading layer axis L.

A state owns its position. `slots` counts the slots written so far (pads included); `lengths`
counts each sequence's real tokens, which is the rotary position of its next token. Pads come
only from left-padded prompt blocks (see `Span.real`); a sequence's real tokens then get the
positions 0, 1, 2... they would get alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import StateMismatchError


def row_runs(idx: list[int]) -> list[tuple[int, int, int]]:
    """The contiguous runs of row indices `idx`: (first source row, first destination row, length)."""
    runs: list[list[int]] = []
    for dst, src in enumerate(idx):
        if runs and runs[-1][0] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


def take_rows(t: torch.Tensor, idx: list[int], dim: int) -> torch.Tensor:
    """A copy of rows `idx` of `t` along `dim`, run by run (`row_runs`): a server dropping one finished
    row of 16 copies two strided runs instead of gathering 15 rows into a temporary and copying that
    again, as advanced indexing does."""
    parts = [t.narrow(dim, src, n) for src, _, n in row_runs(idx)]
    if not parts:
        return t.narrow(dim, 0, 0).clone()
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim)


@dataclass
class Span:
    """One call's bookkeeping, computed once by `State.open()` and shared by every layer."""
    start: int                          # state.slots before this call
    length: int                         # T
    positions: torch.Tensor | None      # (B, T) int64 rotary positions once padded; None: start..start+T-1
    real: torch.Tensor | None           # (B, T) bool, False at pads; None: no pads
    attn_mask: torch.Tensor | None = None   # softmax only: (B, 1, T, start + T) bool, True = attend


@dataclass(eq=False)
class State:
    """Fields and calls common to KVState and LinearState (see their modules for the tensors)."""
    lengths: torch.Tensor   # (B,) int64 real tokens per sequence
    slots: int              # slots written so far, pads included
    padded: bool = False    # a pad has been written: sequences no longer share positions

    path = ""               # "softmax" or "linear", set by subclasses
    max_len = None          # capacity in slots (a property on KVState); None: the state does not grow

    # ------------------------------------------------------------------ the protocol
    @classmethod
    def allocate(cls, cfg, batch: int, max_len: int | None, device, dtype,
                 feature_map: str | None = None) -> "State":
        """A state for `batch` sequences, allocated once; `step()` never grows it."""
        raise NotImplementedError

    def open(self, tokens: torch.Tensor, real: torch.Tensor | None = None) -> Span:
        """tokens (B, T); real (B, T) bool, False at left pads. Checks shapes and capacity."""
        self._check(tokens, real)
        T = tokens.shape[1]
        if real is not None:
            if bool(real.all()):
                real = None
            else:
                self.padded = True
        # unpadded sequences all sit at start..start+T-1: no per-sequence positions to build
        return Span(self.slots, T, self._positions(T, real) if self.padded else None, real)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: Span) -> torch.Tensor:
        """q (B, H, T, D); k, v (B, Hkv, T, D): write the span's keys/values, return (B, H, T, Dv)."""
        raise NotImplementedError

    def commit(self, span: Span) -> None:
        """Advance the state's own position past `span` (once per model step, after every layer)."""
        self.slots += span.length
        if span.real is None:
            self.lengths += span.length
        else:
            self.lengths += span.real.sum(1)

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ saving and batching
    def identity(self) -> dict:
        """What a saved state must match to be loaded: path, tensor shapes without the batch and
        slot axes, dtype (and the feature map on the linear path). JSON-able."""
        raise NotImplementedError

    @staticmethod
    def check_same_identity(states: list["State"], what: str) -> None:
        """Refuse to batch states whose identities differ (`what` names what may differ)."""
        for s in states[1:]:
            if s.identity() != states[0].identity():
                raise StateMismatchError(f"states of different {what} cannot share a batch")

    def state_dict(self) -> dict:
        """{"tensors": {name: tensor}, "meta": JSON-able dict}: the tensors (copies, the KV cache cut
        to the slots written), lengths, slots, padded, and `identity()`. See `load_state_dict`."""
        tensors = {name: t.clone() for name, t in self._saved_tensors().items()}
        tensors["lengths"] = self.lengths.clone()
        meta = dict(self.identity(), slots=int(self.slots), padded=bool(self.padded),
                    batch=self.batch_size)
        return {"tensors": tensors, "meta": meta}

    def load_state_dict(self, sd: dict) -> None:
        """Copy a `state_dict()` into this state (same identity and batch; enough capacity), in place."""
        meta, tensors = sd["meta"], sd["tensors"]
        mine = self.identity()
        theirs = {k: meta.get(k) for k in mine}
        if theirs != mine:
            diff = ", ".join(f"{k}: saved {theirs[k]!r}, here {mine[k]!r}" for k in mine if theirs[k] != mine[k])
            raise StateMismatchError(f"the saved state does not fit this state ({diff}); "
                                     f"load it into a state of the same model, path and dtype")
        if meta["batch"] != self.batch_size:
            raise StateMismatchError(f"the saved state holds {meta['batch']} sequences, this state "
                                     f"{self.batch_size}; allocate a state with batch={meta['batch']}")
        if self.max_len is not None and meta["slots"] > self.max_len:
            raise StateMismatchError(f"the saved state holds {meta['slots']} slots but this state has room "
                                     f"for {self.max_len}; allocate it with max_len >= {meta['slots']}")
        self._load_tensors(tensors, meta["slots"])
        self.lengths.copy_(tensors["lengths"])
        self.slots, self.padded = int(meta["slots"]), bool(meta["padded"])

    def select_rows(self, idx, max_len: int | None = None) -> "State":
        """A new state holding rows `idx` (a list of ints) of this one, copied; this state is unchanged.
        A KV cache drops the leading slots that are pads in every kept row and gets capacity
        `max_len` (default: its own minus the slots dropped)."""
        raise NotImplementedError

    @classmethod
    def concat(cls, states: list["State"], max_len: int | None = None) -> "State":
        """One batch state holding the rows of `states` in order (copies; the inputs are unchanged).
        KV caches are right-aligned to the longest (shorter ones get leading pad slots, masked), so
        every row keeps its own positions; `max_len` is the new capacity (default: the largest)."""
        raise NotImplementedError

    def _saved_tensors(self) -> dict:
        raise NotImplementedError

    def _load_tensors(self, tensors: dict, slots: int) -> None:
        raise NotImplementedError

    def _after_regroup(self) -> None:
        """Recompute `padded` after rows were regrouped: False iff every slot of every row is real."""
        self.padded = not bool((self.lengths == self.slots).all())

    # ------------------------------------------------------------------ derived
    @property
    def pos(self) -> int:      # the name earlier releases used for `slots`
        return self.slots

    @property
    def seen(self) -> torch.Tensor:   # the name earlier releases used for `lengths`
        return self.lengths

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def packed(self):
        """This state as a cache keeps it, only read from now on: itself, or a smaller form
        (engine.attention.packed.Packed: a window state's held slots) whose `unpacked()` is equal to it."""
        return self

    def unpacked(self) -> "State":
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's tensors (the per-layer caches; bookkeeping excluded)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _check(self, tokens: torch.Tensor, real: torch.Tensor | None) -> None:
        if tokens.dim() != 2:
            raise StateMismatchError(f"tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        if tokens.shape[0] != self.batch_size:
            raise StateMismatchError(
                f"tokens have batch size {tokens.shape[0]} but the state was allocated for "
                f"{self.batch_size}; allocate a state with init_state(batch={tokens.shape[0]}, ...)")
        if tokens.shape[1] == 0:
            raise StateMismatchError("tokens hold no time steps; pass at least one token")
        if real is not None and real.shape != tokens.shape:
            raise StateMismatchError(
                f"pad mask has shape {tuple(real.shape)}, tokens {tuple(tokens.shape)}; they must match")

    def _positions(self, T: int, real: torch.Tensor | None) -> torch.Tensor:
        if real is None:
            return self.lengths[:, None] + torch.arange(T, device=self.device)
        return self.lengths[:, None] + (real.long().cumsum(1) - 1).clamp_min(0)
