"""What both attention paths share: the block bookkeeping of a decoding state.

Layout convention for the whole code base: activations are (B, T, C); per-head tensors are
(B, H, T, D); caches and states carry a leading layer axis L.

A state owns its position. `pos` counts the slots written so far (pads included); `seen`
counts each sequence's real tokens, which is the rotary position of its next token. Pads
come only from left-padded prompt blocks (see `Block.valid`); a sequence's real tokens
then get the positions 0, 1, 2... they would get alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import StateMismatchError


@dataclass
class Block:
    """Per-call constants, computed once by `State.begin()` and shared by every layer."""
    start: int                          # state.pos before this block
    length: int                         # T
    positions: torch.Tensor | None      # (B, T) int64 rotary positions once padded; None: start..start+T-1
    valid: torch.Tensor | None          # (B, T) bool, False at pads; None: no pads
    mask: torch.Tensor | None = None    # softmax only: (B, 1, T, start + T) bool, True = attend


@dataclass(eq=False)
class State:
    """Fields common to KVState and LinearState (see their modules for the tensors)."""
    seen: torch.Tensor      # (B,) int64 real tokens per sequence
    pos: int                # slots written so far
    padded: bool = False    # a pad has been written: sequences no longer share positions

    path = ""               # "softmax" or "linear", set by subclasses

    @property
    def batch_size(self) -> int:
        return self.seen.shape[0]

    @property
    def device(self) -> torch.device:
        return self.seen.device

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's tensors (the per-layer caches; bookkeeping excluded)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _check(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        if tokens.dim() != 2:
            raise StateMismatchError(f"tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        if tokens.shape[0] != self.batch_size:
            raise StateMismatchError(
                f"tokens have batch size {tokens.shape[0]} but the state was allocated for "
                f"{self.batch_size}; allocate a state with init_state(batch={tokens.shape[0]}, ...)")
        if tokens.shape[1] == 0:
            raise StateMismatchError("tokens hold no time steps; pass at least one token")
        if valid is not None and valid.shape != tokens.shape:
            raise StateMismatchError(
                f"valid mask has shape {tuple(valid.shape)}, tokens {tuple(tokens.shape)}; they must match")

    def _positions(self, T: int, valid: torch.Tensor | None) -> torch.Tensor:
        if valid is None:
            return self.seen[:, None] + torch.arange(T, device=self.device)
        return self.seen[:, None] + (valid.long().cumsum(1) - 1).clamp_min(0)

    def begin(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> Block:
        self._check(tokens, valid)
        T = tokens.shape[1]
        if valid is not None:
            if bool(valid.all()):
                valid = None
            else:
                self.padded = True
        # unpadded sequences all sit at start..start+T-1: no per-sequence positions to build
        return Block(self.pos, T, self._positions(T, valid) if self.padded else None, valid)

    def end(self, block: Block) -> None:
        """Advance the state's own position past `block` (called once per model step)."""
        self.pos += block.length
        if block.valid is None:
            self.seen += block.length
        else:
            self.seen += block.valid.sum(1)
