"""A state cut to what it holds, as the server's prefix cache keeps it (`State.packed()`).

A window state keeps W + BLOCK - 1 recent-key slots per layer, the sparse keys' slots and S, z, whatever
its prompt: 14.6 MiB for a 2-token prompt on smollm2-linear's default (22 window layers of 319 slots,
fp32), so 256 MiB of prefix cache held 16 short prompts, and the heap around them stayed resident.
Packed, such a state keeps the slots its rows hold (the newest ones, right-aligned) and drops the
tensors that are all zero (S and z before a key left the window, the sparse cache before a key was
kept); `unpacked()` gives back a state equal to it (zeros where nothing was held: slots the state
masks out and tensors it reads as zero).
"""
from __future__ import annotations

import copy

import torch


class Packed:
    """`state` as `tails` (name: (dim, n): only the last n entries along dim kept) and `elide` (names
    dropped while all zero); `parts`: sub-states packed on their own (a hybrid's). Only read: the
    unpacked state is a fresh one each time."""

    def __init__(self, state, tails: dict[str, tuple[int, int]] = None, elide: tuple[str, ...] = (), parts=None):
        self.shell = copy.copy(state)
        self.held: dict[str, tuple] = {}          # name: (full shape, dtype, kept tensor or None, dim or None)
        for name, (dim, n) in (tails or {}).items():
            t = getattr(state, name)
            self.held[name] = (t.shape, t.dtype, t.narrow(dim, t.shape[dim] - n, n).clone(), dim)
        for name in elide:
            t = getattr(state, name)
            self.held[name] = (t.shape, t.dtype, t.clone() if bool(t.any()) else None, None)
        for name in self.held:
            setattr(self.shell, name, None)
        self.parts = parts
        if parts is not None:
            self.shell.parts = None

    @property
    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for _, _, t, _ in self.held.values() if t is not None)
        return own + sum(p.nbytes for p in self.parts or ())

    def unpacked(self):
        out = copy.copy(self.shell)
        out.lengths = self.shell.lengths.clone()
        for name, (shape, dtype, t, dim) in self.held.items():
            full = torch.zeros(shape, dtype=dtype, device=out.lengths.device)
            if t is not None:
                (full if dim is None else full.narrow(dim, shape[dim] - t.shape[dim], t.shape[dim])).copy_(t)
            setattr(out, name, full)
        if self.parts is not None:
            out.parts = [p.unpacked() for p in self.parts]
        return out
