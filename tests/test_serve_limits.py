"""The server's limits: sampling never returns garbage (extreme but valid settings, degenerate logits),
prompt and body sizes, the queue (clients that gave up leave it, a wait has a timeout), and the
CLI's checks of its limit flags. Servers run in-process on 127.0.0.1 (tests/test_serve_support.py)."""
from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidArgumentError
from engine.sampling import FP32, Sampler, SamplingParams, filtered_logits
from engine.serve.batch_sampling import RowSampler, sample_rows

V = 50


def logits_batch(B=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


def both_samplers(params: SamplingParams, logits: torch.Tensor, prompt=(1, 2, 3)) -> list[list[int]]:
    """The tokens engine.sampling.Sampler (the API's) and the server's sample_rows draw from `logits`."""
    api = Sampler(params, logits.shape[0], V)
    api.observe(torch.tensor([list(prompt)] * logits.shape[0]))
    rows = [RowSampler(params, list(prompt), V) for _ in range(logits.shape[0])]
    return [api.sample(logits).tolist(), sample_rows(rows, logits)]


# ---------------------------------------------------------------------- sampling never returns garbage
UNDERFLOW = {   # settings whose arithmetic underflows in float32: each one acts as its limit
    "top_p=1e-46": SamplingParams(temperature=1.0, top_p=1e-46, seed=1),            # 0 in fp32: top-1
    "top_p=1e-46-T0.5": SamplingParams(temperature=0.5, top_p=1e-46, seed=2),
    "top_p=min-subnormal": SamplingParams(temperature=1.0, top_p=1.4e-45, seed=3),
}


@pytest.mark.parametrize("name", list(UNDERFLOW))
def test_a_top_p_that_underflows_keeps_the_most_likely_token(name):
    x = logits_batch()
    f = filtered_logits(x, UNDERFLOW[name])
    assert torch.isfinite(f).sum(-1).tolist() == [1] * 4          # the nucleus is the top token, never empty
    for tokens in both_samplers(UNDERFLOW[name], x):
        print(name, tokens, x.argmax(-1).tolist())
        assert tokens == x.argmax(-1).tolist()


def test_a_min_p_that_underflows_keeps_every_token():
    x = logits_batch()
    assert torch.isfinite(filtered_logits(x, SamplingParams(min_p=1e-46))).all()


@pytest.mark.parametrize("penalty", [1e-300, 1e-39, 1e39, 1e300], ids=lambda p: f"{p:g}")
def test_a_repetition_penalty_outside_float32_is_refused(penalty):
    with pytest.raises(InvalidArgumentError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)


def test_the_extreme_penalties_float32_holds_are_accepted_and_sample_a_seen_or_the_best_token():
    x = logits_batch()
    for penalty in (FP32.tiny, FP32.max):
        p = SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=4)
        for tokens in both_samplers(p, x, prompt=(1, 2, 3)):
            print(penalty, tokens)
            assert all(0 <= t < V for t in tokens)
            if penalty < 1:   # seen positive logits scaled past float32: the draw is one of them
                assert all(t in (1, 2, 3) for b, t in enumerate(tokens) if (x[b, [1, 2, 3]] > 0).any())


def degenerate_logits() -> torch.Tensor:
    """Rows a model or a filter can hand the sampler: a NaN, a +inf, nothing but -inf, all NaN."""
    x = logits_batch(B=5, seed=3)
    x[0, 7] = float("nan")
    x[1, 11] = float("inf")
    x[2] = float("-inf")
    x[3] = float("nan")
    return x


DEGENERATE = {"plain": SamplingParams(temperature=1.0, seed=5),
              "filters": SamplingParams(temperature=0.7, seed=6, top_k=5, top_p=0.9, min_p=0.01),
              "penalty": SamplingParams(temperature=1.0, seed=7, repetition_penalty=1.3),
              "greedy": SamplingParams(temperature=0)}


@pytest.mark.parametrize("name", list(DEGENERATE))
def test_no_row_is_sampled_from_nan_or_all_zero_probabilities(name):
    """A row softmax cannot make a distribution of takes its greedy token (NaN counted as -inf); the
    old draw landed on the last vocabulary id (its CDF was NaN) or raised (torch.multinomial)."""
    x = degenerate_logits()
    clean = torch.where(torch.isnan(x), float("-inf"), x)
    for tokens in both_samplers(DEGENERATE[name], x, prompt=(40, 41)):
        print(name, tokens)
        assert tokens[0] == clean[0].argmax().item()     # a NaN in the row: never the NaN's id
        assert tokens[1] == 11                           # a +inf: the distribution's limit, all mass there
        assert tokens[2] == tokens[3] == 0               # nothing to choose from: the first id, not the last
        assert 0 <= tokens[4] < V
