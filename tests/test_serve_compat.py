"""OpenAI compatibility of the server, as clients and a peer's test suite see it: a stream's last
token in a chunk of its own and then a chunk carrying finish_reason, n choices sharing one prefill,
presence/frequency penalties and logit_bias (in both samplers, the API's and the server's), a
negative seed, top_p 0, response_format, system_fingerprint. Servers run in-process on 127.0.0.1."""
from __future__ import annotations

import json

import pytest
import torch

from engine.errors import InvalidArgumentError
from engine.sampling import Sampler, SamplingParams, apply_presence_frequency, filtered_logits
from engine.serve.batch_sampling import RowSampler, sample_rows

V = 40


# ---------------------------------------------------------------------- the samplers
def logits_rows(B=3, seed=0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 2


def run_both(params: SamplingParams, steps: list[torch.Tensor], prompt=(1, 2, 3)) -> list[list[list[int]]]:
    """The tokens the API's Sampler and the server's sample_rows draw from a sequence of (B, V) logits:
    [api tokens per step, server tokens per step]."""
    B = steps[0].shape[0]
    api = Sampler(params, B, V)
    api.observe(torch.tensor([list(prompt)] * B))
    rows = [RowSampler(params, list(prompt), V) for _ in range(B)]
    return [[api.sample(x).tolist() for x in steps], [sample_rows(rows, x) for x in steps]]


def reference_greedy(params: SamplingParams, steps: list[torch.Tensor]) -> list[list[int]]:
    """Greedy tokens under OpenAI's definitions, written out: logit + bias - p * (c > 0) - f * c over
    the tokens generated so far (not the prompt)."""
    B = steps[0].shape[0]
    counts = [[0] * V for _ in range(B)]
    out = []
    for x in steps:
        row = []
        for b in range(B):
            adj = [float(x[b, j]) + dict(params.logit_bias).get(j, 0.0)
                   - params.presence_penalty * (counts[b][j] > 0) - params.frequency_penalty * counts[b][j]
                   for j in range(V)]
            t = max(range(V), key=lambda j: adj[j])
            counts[b][t] += 1
            row.append(t)
        out.append(row)
    return out


def test_presence_and_frequency_penalties_follow_openais_formula():
    x, counts = logits_rows(), torch.zeros(3, V, dtype=torch.int32)
    counts[0, 5], counts[1, 5], counts[1, 7] = 3, 1, 2
    got = apply_presence_frequency(x, counts, 0.5, 0.25)
    want = x.clone()
    want[0, 5] -= 0.5 + 0.75
    want[1, 5] -= 0.5 + 0.25
    want[1, 7] -= 0.5 + 0.5
    assert torch.allclose(got, want)


@pytest.mark.parametrize("kw", [dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                                dict(presence_penalty=1.0, frequency_penalty=0.5), dict(frequency_penalty=-1.0),
                                dict(logit_bias={3: 100.0}), dict(logit_bias={0: -100.0, 9: 4.0}, frequency_penalty=1)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_greedy_with_penalties_and_bias_equals_the_written_out_rule_in_both_samplers(kw):
    """Constant logits for 12 steps: without penalties the same token every step; with them the
    generated tokens are penalized as OpenAI defines (the prompt's are not), in both samplers."""
    x = logits_rows()
    x[:, 1] = x.max() + 1.0        # a prompt token is the best: a penalty on it would show
    params = SamplingParams(temperature=0, **kw)
    steps = [x] * 12
    want = reference_greedy(params, steps)
    api, server = run_both(params, steps)
    print(kw, want)
    assert api == want and server == want
    if kw.get("frequency_penalty", 0) > 0 or kw.get("presence_penalty", 0) > 0:
        assert want != [[1] * 3] * 12   # the penalty moved the choice off the (unpenalized) prompt token


def test_penalties_and_bias_in_a_sampled_row_keep_the_server_row_independent_of_its_batch():
    p = SamplingParams(temperature=1.0, seed=11, frequency_penalty=1.5, logit_bias={4: 5.0})
    steps = [logits_rows(B=3, seed=s) for s in range(8)]
    solo = RowSampler(p, [1], V)
    alone = [sample_rows([solo], x[1:2]) for x in steps]
    rows = [RowSampler(SamplingParams(temperature=0.7, seed=3), [1], V), RowSampler(p, [1], V),
            RowSampler(SamplingParams(temperature=0), [1], V)]
    batched = [sample_rows(rows, x)[1:2] for x in steps]
    assert batched == alone


@pytest.mark.parametrize("kw,name", [(dict(presence_penalty=2.5), "presence_penalty"),
                                     (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                     (dict(logit_bias={1: 101.0}), "logit_bias"),
                                     (dict(logit_bias={-1: 1.0}), "logit_bias"),
                                     (dict(logit_bias={"a": 1.0}), "logit_bias")])
def test_bad_penalties_and_biases_are_refused(kw, name):
    with pytest.raises(InvalidArgumentError, match=name):
        SamplingParams(**kw)


def test_a_bias_outside_the_vocabulary_is_refused_by_the_api_sampler():
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias={V: 1.0}), 1, V)


def test_filtered_logits_applies_the_bias_before_the_filters():
    x = logits_rows(B=1)
    low = int(x.argmin())
    f = filtered_logits(x, SamplingParams(temperature=1.0, top_k=1, logit_bias={low: 100.0}))
    assert torch.isfinite(f).sum() == 1 and torch.isfinite(f[0, low])
