"""Left-padded batches: every real token gets the logits it gets alone, on both paths."""
import pytest
import torch

from tests.conftest import tiny_model

PATHS = ["softmax", "linear"]


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pads", [0, 1, 7], ids=lambda p: f"pads{p}")
def test_padded_batch_equals_each_sequence_alone(path, pads):
    model = tiny_model(num_key_value_heads=2)
    g = torch.Generator().manual_seed(pads)
    long_seq = torch.randint(3, 97, (10,), generator=g)
    short_seq = torch.randint(3, 97, (10 - pads,), generator=g)
    tokens = torch.stack([long_seq, torch.cat([torch.zeros(pads, dtype=torch.long), short_seq])])
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, :pads] = False
    state = model.init_state(2, 16, path)
    batch_prefill = model.step(tokens, state, valid=valid)
    nxt = torch.randint(3, 97, (2, 3), generator=g)
    batch_steps = torch.cat([model.step(nxt[:, i:i + 1], state) for i in range(3)], 1)
    for row, seq in enumerate([long_seq, short_seq]):
        alone_state = model.init_state(1, 16, path)
        alone = model.step(seq[None], alone_state)
        alone_steps = torch.cat([model.step(nxt[row:row + 1, i:i + 1], alone_state) for i in range(3)], 1)
        first = pads if row == 1 else 0
        assert max_diff(batch_prefill[row, first:], alone[0]) <= 1e-5
        assert max_diff(batch_steps[row], alone_steps[0]) <= 1e-5
    assert state.seen.tolist() == [13, 13 - pads]


@pytest.mark.parametrize("path", PATHS)
def test_full_forward_with_padding_matches_alone(path):
    model = tiny_model()
    seq = torch.randint(3, 97, (6,), generator=torch.Generator().manual_seed(5))
    tokens = torch.cat([torch.zeros(3, dtype=torch.long), seq])[None]
    valid = torch.tensor([[False] * 3 + [True] * 6])
    with torch.no_grad():
        for reference in (False, True):
            padded = model(tokens, path, valid=valid, reference=reference)[0, 3:]
            assert max_diff(padded, model(seq[None], path, reference=reference)[0]) <= 1e-5


@pytest.mark.parametrize("fmap", ["elu1", "relu", "softmax", "cos1"])
def test_linear_pads_leave_state_untouched(fmap):
    """elu(0)+1 = 1: pads must be masked after the feature map or they enter z (PITFALLS #10)."""
    model = tiny_model()
    state = model.init_state(1, None, "linear", feature_map=fmap)
    model.step(torch.tensor([[5, 6, 7]]), state, valid=torch.tensor([[False, False, False]]))
    assert torch.count_nonzero(state.S) == 0 and torch.count_nonzero(state.z) == 0
    assert state.seen.tolist() == [0]
