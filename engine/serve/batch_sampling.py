"""Sampling a whole decode batch at once, each row with its own settings and its own seeded draw.

    samplers = [RowSampler(params, prompt_ids, vocab_size) for each job]
    tokens = sample_rows(samplers, logits)          # logits (B, V) -> B token ids (list of int)

Rows that share settings (temperature, top_k, top_p, min_p, the penalties, the logit bias) are
filtered as one (k, V) block by `engine.sampling.filtered_logits` (row-wise pure functions, the
API's sampler's too: bias, penalties, temperature, top-k, top-p, min-p in that order) and greedy
rows take one argmax. A sampled row then draws ONE uniform number from its own torch.Generator
(seeded with the request's seed) and inverts its own CDF (fp64 cumulative sum, `searchsorted`). So
a request's tokens depend on its seed and its logits only: the same whether it runs alone or in any
batch, in any row.

Per step a group costs a fixed handful of tensor ops whatever its size (the server's Python per
token is what batching cannot amortize): a row's uniforms are drawn UNIFORM_BLOCK at a time (CPU
generators fill a tensor serially: the same numbers, in the same order, as one draw per token; a
test holds this), and the draw's scalar arithmetic (u * total, below total) runs on Python floats,
the same IEEE double operations the tensor form did.

Why not `engine.sampling.Sampler` (what `gen` and the Python API use): its torch.multinomial draws V
exponential numbers per token (torch's Gumbel-max form), ~0.1 ms a row at V = 4096 and ~1 ms at
V = 49152, one call per row. Here a row costs one uniform. Greedy tokens are the same as the API's;
a seeded sampled request is reproducible on the server but is not the same draw as `gen --seed`.
"""
from __future__ import annotations

import math
import os

import torch

from engine.sampling import SamplingParams, filtered_logits, greedy_ids

UNIFORM_BLOCK = 64   # uniforms a sampled row draws from its generator at a time


class RowSampler:
    """One request's sampling state: its settings, its generator, the tokens it has seen (for the
    repetition penalty: the prompt and every token drawn) and how often it drew each (for the
    presence and frequency penalties)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device="cpu"):
        self.params = params
        self.key = (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty,
                    params.presence_penalty, params.frequency_penalty, params.logit_bias)
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        self._uniforms: list[float] = []
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)   # (1, V)
            self.seen[0, torch.as_tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.counts = (torch.zeros(1, vocab_size, dtype=torch.int32, device=device)   # (1, V)
                       if params.counts_tokens else None)

    def observe(self, token: int) -> None:
        if self.seen is not None:
            self.seen[0, token] = True
        if self.counts is not None:
            self.counts[0, token] += 1

    def uniform(self) -> float:
        """The row's next uniform number in [0, 1) (fp64), as torch.rand(1, generator=...) would give it."""
        if not self._uniforms:
            block = torch.rand(UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64).tolist()
            self._uniforms = block[::-1]   # popped from the end: in draw order
        return self._uniforms.pop()


def sample_rows(samplers: list[RowSampler], logits: torch.Tensor) -> list[int]:
    """logits (B, V), row b for samplers[b] -> B token ids; each sampler observes its token."""
    B, V = logits.shape
    groups: dict[tuple, list[int]] = {}
    for b, s in enumerate(samplers):
        groups.setdefault(s.key, []).append(b)
    out = [0] * B
    for rows in groups.values():
        first = samplers[rows[0]]
        raw = logits if len(rows) == B else logits[rows]                                # (k, V)
        seen = torch.cat([samplers[b].seen for b in rows]) if first.seen is not None else None
        counts = torch.cat([samplers[b].counts for b in rows]) if first.counts is not None else None
        x = filtered_logits(raw, first.params, seen, counts)
        if first.params.greedy:
            tokens = greedy_ids(x, raw).tolist()
        else:
            cdf = x.softmax(-1).double().cumsum(-1)                                     # (k, V)
            # u < 1, so u * total < total: the first index whose CDF passes the target is a token of
            # nonzero weight; the target is kept below total against rounding
            totals = cdf[:, -1].tolist()
            targets = [min(samplers[b].uniform() * total, math.nextafter(total, 0.0))
                       for b, total in zip(rows, totals)]
            target = torch.tensor(targets, dtype=torch.float64, device=cdf.device)[:, None]   # (k, 1)
            tokens = [min(t, V - 1) for t in torch.searchsorted(cdf, target, right=True)[:, 0].tolist()]
            if not all(total > 0 for total in totals):   # NaN probabilities (a NaN, +inf or no token left in
                # the row: the CDF would land on the last id): the greedy token
                fallback = greedy_ids(x, raw).tolist()
                tokens = [t if total > 0 else f for t, f, total in zip(tokens, fallback, totals)]
        for b, t in zip(rows, tokens):
            out[b] = t
            samplers[b].observe(t)
    return out
