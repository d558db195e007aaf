"""The shared-context scorer (engine.tasks.scoring): every request's log-likelihood equals the one a
plain full forward over context + continuation gives, on every attention path, whatever the batching."""
import pytest
import torch

from engine.errors import InvalidArgumentError
from engine.tasks.scoring import Scorer
from tests.conftest import tiny_model

CONFIGS = {
    "softmax": dict(attention="softmax"),
    "linear-elu1": dict(attention="linear"),
    "linear-hedgehog": dict(attention="linear", feature_map="hedgehog"),
    "hybrid": dict(attention="hybrid", num_hidden_layers=3, layer_attention=("linear", "softmax", "linear")),
    "window": dict(attention="linear", window=3, num_key_value_heads=2),
    "hybrid-window": dict(attention="hybrid", num_hidden_layers=3, layer_attention=("softmax", "linear", "linear"),
                          window=4),
}


def requests(seed=0):
    """Groups of 1-4 continuations (lengths 1-6) of contexts of 1-12 tokens; two groups share a context."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 97, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for n_ctx in (1, 5, 12, 3, 8, 1, 7):
        ctx = rand(n_ctx)
        for n_cont in (1, 4, 6, 2)[:1 + n_ctx % 4]:
            out.append((ctx, rand(n_cont)))
    out.append((out[2][0], rand(3)))          # the same context again, later in the list
    return out


def plain(model, attention, ctx, cont):
    """log p(cont | ctx) and greedy from one unbatched forward over ctx + cont."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        lp = model(ids[:, :-1], attention=attention).float().log_softmax(-1)[0, len(ctx) - 1:]
    target = torch.tensor(cont)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


@pytest.mark.parametrize("batch_tokens", [2, 64, 4096], ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("name", CONFIGS)
def test_scores_equal_a_plain_forward(name, batch_tokens):
    cfg = dict(CONFIGS[name])
    attention = cfg.pop("attention")
    model = tiny_model(seed=1, attention=attention, **cfg)
    reqs = requests()
    scorer = Scorer(model, attention=attention, batch_tokens=batch_tokens)
    got = scorer.score(reqs)
    want = [plain(model, attention, c, x) for c, x in reqs]
    worst = max(abs(a[0] - b[0]) for a, b in zip(got, want))
    print(f"{name}: max |diff| {worst:.2e} over {len(reqs)} requests")
    assert worst <= 1e-4
    assert [a[1] for a in got] == [b[1] for b in want]
    # each shared context is prefilled once: fewer tokens fed than scoring every request from scratch
    assert scorer.stats.requests == len(reqs)
    assert scorer.stats.fed_tokens < scorer.stats.request_tokens


def test_greedy_flag_is_true_for_the_argmax_continuation():
    model = tiny_model(seed=2)
    ctx = [5, 9, 14]
    greedy = []
    ids = list(ctx)
    for _ in range(3):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(nxt)
        greedy.append(nxt)
    other = greedy[:2] + [(greedy[2] + 1) % 97]
    (_, yes), (_, no) = Scorer(model, attention="softmax").score([(ctx, greedy), (ctx, other)])
    assert yes and not no


@pytest.mark.parametrize("bad", [([], [1]), ([1], []), ([1, 500], [2])])
def test_bad_requests_are_one_line(bad):
    with pytest.raises(InvalidArgumentError) as e:
        Scorer(tiny_model()).score([bad])
    assert "\n" not in str(e.value)
