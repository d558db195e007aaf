"""The serve scheduler's batched sampler: each row's draws equal the row sampled alone (any batch, any
row order, mixed settings), seeded draws are reproducible, the draw follows the filtered distribution
(filtered and zero-probability tokens never come out), greedy rows equal engine.sampling's argmax."""
from __future__ import annotations

import torch

from engine.sampling import Sampler, SamplingParams, filtered_logits
from engine.serve.batch_sampling import UNIFORM_BLOCK, RowSampler, sample_rows

V = 97
SETTINGS = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=1),
            SamplingParams(temperature=0.9, seed=2), SamplingParams(temperature=0.9, seed=2, top_k=20),
            SamplingParams(temperature=1.1, seed=3, top_p=0.8, min_p=0.05),
            SamplingParams(temperature=0.7, seed=4, repetition_penalty=1.3),
            SamplingParams(temperature=0, repetition_penalty=1.5)]


def logits_stream(steps, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, V, generator=g) * 3 for _ in range(steps)]


def run(settings, stream, prompt=(1, 2, 3)):
    samplers = [RowSampler(p, list(prompt), V) for p in settings]
    return [sample_rows(samplers, x) for x in stream]


def test_every_row_draws_what_it_draws_alone_in_any_order():
    stream = logits_stream(40, len(SETTINGS))
    together = run(SETTINGS, stream)
    for b, p in enumerate(SETTINGS):
        alone = run([p], [x[b:b + 1] for x in stream])
        assert [t[b] for t in together] == [t[0] for t in alone], f"row {b} ({p})"
    order = list(reversed(range(len(SETTINGS))))
    shuffled = run([SETTINGS[b] for b in order], [x[order] for x in stream])
    assert [[t[order.index(b)] for b in range(len(SETTINGS))] for t in shuffled] == together


def test_seeded_draws_repeat_and_seeds_differ():
    stream = logits_stream(30, 1, seed=5)
    a = run([SamplingParams(temperature=1.0, seed=11)], stream)
    assert a == run([SamplingParams(temperature=1.0, seed=11)], stream)
    assert a != run([SamplingParams(temperature=1.0, seed=12)], stream)


def test_draws_follow_the_filtered_distribution():
    probs = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4] + [0.0] * (V - 5))
    logits = probs.log()[None]                                       # zero probability: -inf
    s = RowSampler(SamplingParams(temperature=1.0, seed=0), [], V)
    n = 20000
    counts = torch.bincount(torch.tensor([sample_rows([s], logits)[0] for _ in range(n)]), minlength=V)
    freq = counts.float() / n
    print(freq[:5])
    assert counts[2] == 0 and counts[5:].sum() == 0
    assert (freq[:5] - probs[:5]).abs().max() < 0.015
    top2 = RowSampler(SamplingParams(temperature=1.0, seed=0, top_k=2), [], V)
    assert set(sample_rows([top2], logits)[0] for _ in range(500)) == {3, 4}


def test_greedy_rows_equal_the_api_sampler():
    stream = logits_stream(20, 2, seed=7)
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.5)):
        ref = Sampler(p, 1, V)
        ref.observe(torch.tensor([[1, 2, 3]]))
        want = [int(ref.sample(x[:1])[0]) for x in stream]
        assert [t[0] for t in run([p], [x[:1] for x in stream])] == want


def reference_rows(samplers, logits):
    """The draw as first written (one torch.rand(1) per row and token, the target in tensor ops): the
    faster form must pick exactly these tokens, so a seeded request keeps its output."""
    out = []
    for b, s in enumerate(samplers):
        x = filtered_logits(logits[b:b + 1], s.params, s.seen)
        if s.params.greedy:
            t = int(x.argmax(-1))
        else:
            cdf = x.softmax(-1).double().cumsum(-1)
            u = torch.rand(1, generator=s.generator, dtype=torch.float64)
            total = cdf[:, -1]
            target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
            t = int(torch.searchsorted(cdf, target[:, None], right=True)[0, 0].clamp_max(x.shape[-1] - 1))
        s.observe(t)
        out.append(t)
    return out


def test_draws_equal_the_first_form_token_for_token():
    stream = logits_stream(3 * UNIFORM_BLOCK + 5, len(SETTINGS), seed=9)   # past several uniform blocks
    fast = run(SETTINGS, stream)
    ref_samplers = [RowSampler(p, [1, 2, 3], V) for p in SETTINGS]
    assert fast == [reference_rows(ref_samplers, x) for x in stream]


def test_uniforms_drawn_in_blocks_equal_one_draw_at_a_time():
    s = RowSampler(SamplingParams(temperature=1.0, seed=123), [], V)
    g = torch.Generator().manual_seed(123)
    one_by_one = [torch.rand(1, generator=g, dtype=torch.float64).item() for _ in range(2 * UNIFORM_BLOCK + 3)]
    assert [s.uniform() for _ in range(len(one_by_one))] == one_by_one
