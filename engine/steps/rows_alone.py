"""A prompt block of several rows run row by row: each prompt prefilled exactly as it is alone.

A batch's prompts of different lengths arrive left-padded (engine.generate.left_pad). Run as one
block, a row's numbers depend on its neighbours: the pads move its keys inside the blocked sums
(chunked linear attention, masked attention kernels), and even without pads PyTorch's matmuls pick
their kernels by the number of rows. A form that rounds activations to q8 blocks (the native step
on quantized weights) turns those last-bit differences into steps, so the greedy ids of a prompt
changed with the other prompts of its batch (PITFALLS #22). Here each row's real tokens are
prefilled on a one-row copy of its state by the form that prefills it alone, and the rows are
joined back as the server's scheduler joins requests (`State.concat`: KV rows right-aligned, pads
first and masked), which is the left-padded layout.
"""
from __future__ import annotations

import torch

from engine.attention.base import State


def rows_alone_apply(tokens: torch.Tensor, state, valid: torch.Tensor | None) -> bool:
    """True for a block this module can run (several rows, or pads): every row's real tokens a
    non-empty suffix (pads only first; valid None: no pads), on a state that regroups rows and has room for
    the block (else the module path runs it, and raises what it raises)."""
    if tokens.dim() != 2 or not isinstance(state, State) or (valid is None and tokens.shape[0] < 2):
        return False
    if state.max_len is not None and state.slots + tokens.shape[1] > state.max_len:
        return False
    if valid is None:
        return True
    n = valid.sum(1)
    suffix = torch.arange(tokens.shape[1], device=valid.device)[None, :] >= (tokens.shape[1] - n)[:, None]
    return bool((n > 0).all()) and torch.equal(valid, suffix)


def prefill_rows_alone(prefill, tokens: torch.Tensor, state, valid: torch.Tensor | None) -> torch.Tensor:
    """tokens (B, T) with pads where `valid` is False (None: none) -> each row's last logits
    (B, 1, V); `state` then holds every row as `prefill(row_tokens (1, n), row_state)` left it.

    prefill: the one-row prompt block call (the Stepper itself, so each row runs the form it runs alone)."""
    B, T = tokens.shape
    counts = [T] * B if valid is None else valid.sum(1).tolist()
    rows, logits = [], []
    for b, n in enumerate(counts):
        row = state.select_rows([b], max_len=state.slots + T if state.max_len is not None else None)
        logits.append(prefill(tokens[b:b + 1, T - n:], row))
        rows.append(row)
    state.load_state_dict(type(state).concat(rows).state_dict())
    return torch.cat(logits)
