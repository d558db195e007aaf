"""The sampler: greedy, filters, the sign-aware repetition penalty, seeds and per-request RNGs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.api import load
from engine.errors import InvalidArgumentError
from engine.sampling import (Sampler, SamplingParams, apply_repetition_penalty, filtered_logits,
                             min_p_filter, top_k_filter, top_p_filter)


def logits_batch(B=3, V=50, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


# ---------------------------------------------------------------------- arguments
BAD = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    ("top_k", -1), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.01),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.2),
    ("seed", -1), ("seed", "7"),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_bad_settings_are_refused(name, value):
    with pytest.raises(InvalidArgumentError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name,value", [("temperature", 0), ("top_p", 1.0), ("min_p", 0.0), ("min_p", 1.0),
                                        ("top_k", 0), ("repetition_penalty", 0.5)],
                         ids=lambda x: str(x))
def test_edge_settings_are_accepted(name, value):
    SamplingParams(**{name: value})


# ---------------------------------------------------------------------- greedy
def test_temperature_zero_is_argmax_and_top_k_one():
    x = logits_batch()
    greedy = Sampler(SamplingParams(temperature=0), 3, 50).sample(x)
    top1 = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=5), 3, 50).sample(x)
    print(greedy.tolist(), top1.tolist(), x.argmax(-1).tolist())
    assert torch.equal(greedy, x.argmax(-1)) and torch.equal(top1, x.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-8, 1e-6, 1e-4], ids=lambda t: f"T{t:g}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_tiny_temperature_gives_argmax_without_nan(temperature, dtype):
    x = (logits_batch(scale=20.0)).to(dtype)
    f = filtered_logits(x, SamplingParams(temperature=temperature))
    probs = f.softmax(-1)
    print(temperature, dtype, f.abs().max().item())
    assert not torch.isnan(probs).any()
    tokens = Sampler(SamplingParams(temperature=temperature, seed=0), 3, 50).sample(x)
    assert torch.equal(tokens, x.float().argmax(-1))


# ---------------------------------------------------------------------- filters
def probs_logits(p):
    return torch.tensor([[math.log(v) for v in p]])


def kept(logits):
    return torch.isfinite(logits)[0].tolist()


def test_top_k_keeps_exactly_k():
    x = logits_batch(B=4, V=30)
    for k in (1, 5, 29):
        f = top_k_filter(x, k)
        assert (torch.isfinite(f).sum(-1) == k).all()
        assert torch.equal(f.argmax(-1), x.argmax(-1))
    assert torch.equal(top_k_filter(x, 0), x) and torch.equal(top_k_filter(x, 30), x)


@pytest.mark.parametrize("p,expect", [(0.5, [1, 0, 0, 0]), (0.8, [1, 1, 0, 0]), (0.81, [1, 1, 1, 0]),
                                      (1.0, [1, 1, 1, 1]), (0.01, [1, 0, 0, 0])], ids=lambda v: str(v))
def test_top_p_keeps_the_nucleus(p, expect):
    x = probs_logits([0.15, 0.5, 0.05, 0.3])[:, [1, 3, 0, 2]]     # sorted: 0.5, 0.3, 0.15, 0.05
    assert kept(top_p_filter(x, p)) == [bool(e) for e in expect]
    shuffled = x[:, [2, 0, 3, 1]]                                  # the order of the vocabulary does not matter
    assert kept(top_p_filter(shuffled, p)) == [bool(expect[i]) for i in [2, 0, 3, 1]]


@pytest.mark.parametrize("p,expect", [(0.0, [1, 1, 1, 1]), (0.3, [1, 1, 1, 0]), (0.5, [1, 1, 0, 0]),
                                      (1.0, [1, 0, 0, 0])], ids=lambda v: str(v))
def test_min_p_drops_below_a_fraction_of_the_best(p, expect):
    x = probs_logits([0.5, 0.3, 0.15, 0.05])
    assert kept(min_p_filter(x, p)) == [bool(e) for e in expect]


def test_draws_follow_the_distribution():
    x = probs_logits([0.6, 0.3, 0.1, 1e-9])
    s = Sampler(SamplingParams(temperature=1.0, seed=11), 1, 4)
    counts = torch.bincount(torch.cat([s.sample(x) for _ in range(3000)]), minlength=4).double() / 3000
    print(counts.tolist())
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1, 0.0], dtype=torch.float64), atol=0.03)


def test_temperature_sharpens():
    x = probs_logits([0.6, 0.4])
    cold = filtered_logits(x, SamplingParams(temperature=0.5)).softmax(-1)[0, 0].item()
    hot = filtered_logits(x, SamplingParams(temperature=2.0)).softmax(-1)[0, 0].item()
    print(cold, hot)
    assert cold > 0.6 > hot > 0.5


# ---------------------------------------------------------------------- repetition penalty
def test_penalty_lowers_every_seen_token_whatever_its_sign():
    x = torch.tensor([[2.0, -1.5, 0.7, -0.2, 3.0, -4.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, True, False, True, False, False]])
    y = apply_repetition_penalty(x, seen, 1.5)
    logp_x, logp_y = x.log_softmax(-1)[0], y.log_softmax(-1)[0]
    print("before", x.tolist(), "after", y.tolist())
    for i in range(8):
        if seen[0, i]:
            assert y[0, i] < x[0, i]
            for j in range(8):   # its odds against every unseen token drop
                if not seen[0, j]:
                    assert logp_y[i] - logp_y[j] < logp_x[i] - logp_x[j]
        else:
            assert y[0, i] == x[0, i]


@pytest.mark.parametrize("logit", [-3.0, -0.5, 0.5, 3.0], ids=lambda v: f"logit{v:+}")
def test_one_seen_token_loses_probability(logit):
    x = torch.tensor([[logit, 1.0, -1.0, 0.2]])
    seen = torch.tensor([[True, False, False, False]])
    before = x.softmax(-1)[0, 0]
    after = apply_repetition_penalty(x, seen, 1.3).softmax(-1)[0, 0]
    naive = (x / 1.3).softmax(-1)[0, 0]                  # the bug: dividing a negative logit raises it
    print(logit, before.item(), after.item(), naive.item())
    assert after < before
    if logit < 0:
        assert naive > before            # negative control: the test tells the bug apart


def test_penalty_applies_once_per_distinct_token_and_counts_the_prompt_not_pads():
    V, penalty = 10, 2.0
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, -1.0, -2.0, 0.5, 0.25, 0.1, -0.1]])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=penalty), 1, V)
    prompt = torch.tensor([[0, 3, 3, 3, 5, 5]])
    valid = torch.tensor([[False, True, True, True, True, True]])   # id 0 is a left pad here
    s.observe(prompt, valid)
    got = filtered_logits(x, s.params, s.seen)
    want = x.clone()
    want[0, 3] = 1.0 / penalty            # once, though it occurs three times
    want[0, 5] = -2.0 * penalty
    print(got.tolist())
    assert torch.equal(got, want)
    assert s.sample(x).item() == 0       # the pad's id was not marked: 4.0 still wins
    assert s.seen[0, 0]                  # ... and now it is seen
    assert s.sample(x).item() == 1


# ---------------------------------------------------------------------- seeds
def draws(seed, steps=30, interfere=False):
    x = logits_batch(B=2, V=40, scale=1.0)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=seed), 2, 40)
    out = []
    for _ in range(steps):
        if interfere:
            torch.rand(7)
            torch.manual_seed(123)
            torch.randn(3)
        out.append(s.sample(x).tolist())
    return out


def test_same_seed_same_ids_despite_global_rng_use():
    a, b = draws(42), draws(42, interfere=True)
    assert a == b
    assert draws(43) != a


def test_interleaved_samplers_do_not_disturb_each_other():
    x = logits_batch(B=1, V=40, scale=1.0)
    alone = [Sampler(SamplingParams(temperature=1.0, seed=s), 1, 40) for s in (1, 2)]
    solo = [[alone[i].sample(x).item() for _ in range(20)] for i in range(2)]
    pair = [Sampler(SamplingParams(temperature=1.0, seed=s), 1, 40) for s in (1, 2)]
    mixed = [[], []]
    for _ in range(20):
        for i in range(2):
            mixed[i].append(pair[i].sample(x).item())
    assert mixed == solo


def test_batch_rows_draw_what_the_prompt_alone_would():
    x1 = logits_batch(B=1, V=40, scale=1.0)
    alone = Sampler(SamplingParams(temperature=1.0, seed=9), 1, 40)
    batch = Sampler(SamplingParams(temperature=1.0, seed=9), 3, 40)
    x3 = torch.cat([logits_batch(B=1, V=40, seed=5), x1, x1])
    a = [alone.sample(x1).item() for _ in range(15)]
    b = [batch.sample(x3)[1:].tolist() for _ in range(15)]
    assert [r[0] for r in b] == a and [r[1] for r in b] == a


def test_a_batch_without_a_seed_samples_each_row_on_its_own(small_model_dir):
    """Copies of one prompt in a batch without a seed are that many samples (each row's own OS seed,
    in its Result), not one sample copied; with a seed every row samples what it would alone."""
    llm = load(str(small_model_dir), backend="torch")
    kw = dict(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    rows = llm.generate(["the cat"] * 4, **kw)
    assert len({r.stats.seed for r in rows}) == 4 and len({tuple(r.ids) for r in rows}) > 1
    for r in rows[:2]:
        assert llm.generate("the cat", seed=r.stats.seed, **kw).ids == r.ids
    a, b = llm.generate(["the cat"] * 2, seed=3, **kw)
    assert a.ids == b.ids == llm.generate("the cat", seed=3, **kw).ids and a.stats.seed == b.stats.seed == 3


def test_no_seed_gives_fresh_seeds_without_touching_the_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    seeds = {Sampler(SamplingParams(temperature=1.0), 1, 4).seed for _ in range(5)}
    assert len(seeds) == 5
    assert torch.equal(torch.get_rng_state(), before)
