"""Sampling a whole decode batch at once, each row with its own settings and its own seeded draw.

    samplers = [RowSampler(params, prompt_ids, vocab_size) for each job]
    tokens = sample_rows(samplers, logits)          # logits (B, V) -> B token ids (list of int)

Rows that share settings (temperature, top_k, top_p, min_p, repetition penalty) are filtered as one
(k, V) block by `engine.sampling.filtered_logits` (row-wise pure functions: penalty, temperature,
top-k, top-p, min-p in that order) and greedy rows take one argmax. A sampled row then draws ONE
uniform number from its own torch.Generator (seeded with the request's seed) and inverts its own
CDF (fp64 cumulative sum, `searchsorted`). So a request's tokens depend on its seed and its logits
only: the same whether it runs alone or in any batch, in any row.

Why not `engine.sampling.Sampler` (what `gen` and the Python API use): its torch.multinomial draws V
exponential numbers per token (torch's Gumbel-max form), ~0.1 ms a row at V = 4096 and ~1 ms at
V = 49152, one call per row. Here a row costs one uniform. Greedy tokens are the same as the API's;
a seeded sampled request is reproducible on the server but is not the same draw as `gen --seed`.
"""
from __future__ import annotations

import os

import torch

from engine.sampling import SamplingParams, filtered_logits


class RowSampler:
    """One request's sampling state: its settings, its generator, the tokens it has seen (for the
    repetition penalty: the prompt and every token drawn)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device="cpu"):
        self.params = params
        self.key = (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty)
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)   # (1, V)
            self.seen[0, torch.as_tensor(prompt_ids, dtype=torch.long, device=device)] = True

    def observe(self, token: int) -> None:
        if self.seen is not None:
            self.seen[0, token] = True


def sample_rows(samplers: list[RowSampler], logits: torch.Tensor) -> list[int]:
    """logits (B, V), row b for samplers[b] -> B token ids; each sampler observes its token."""
    B, V = logits.shape
    groups: dict[tuple, list[int]] = {}
    for b, s in enumerate(samplers):
        groups.setdefault(s.key, []).append(b)
    out = [0] * B
    for rows in groups.values():
        first = samplers[rows[0]]
        x = logits if len(rows) == B else logits[rows]                                  # (k, V)
        seen = torch.cat([samplers[b].seen for b in rows]) if first.seen is not None else None
        x = filtered_logits(x, first.params, seen)
        if first.params.greedy:
            tokens = x.argmax(-1)
        else:
            cdf = x.softmax(-1).double().cumsum(-1)                                     # (k, V)
            u = torch.cat([torch.rand(1, generator=samplers[b].generator, dtype=torch.float64) for b in rows])
            total = cdf[:, -1]
            # u < 1, so u * total < total: the first index whose CDF passes it is a token of nonzero weight
            target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
            tokens = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_max(V - 1)
        for b, t in zip(rows, tokens.tolist()):
            out[b] = t
            samplers[b].observe(t)
    return out
