"""Softmax path: prefill + step() against the uncached full forward, padding, errors."""
import pytest
import torch

from engine.errors import ContextFullError, InvalidArgumentError, StateMismatchError
from tests.conftest import tiny_model

T = 12
GQA = [pytest.param(4, id="MHA-H4-Hkv4"), pytest.param(2, id="GQA-H4-Hkv2"), pytest.param(1, id="MQA-H4-Hkv1")]


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


@pytest.mark.parametrize("kv_heads", GQA)
def test_fast_full_forward_equals_reference(kv_heads):
    model = tiny_model(num_key_value_heads=kv_heads)
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(model(tokens, "softmax"), model(tokens, "softmax", reference=True)) <= 1e-5


@pytest.mark.parametrize("kv_heads", GQA)
@pytest.mark.parametrize("split", range(1, T + 1), ids=lambda t: f"prefill{t}")
def test_prefill_then_steps_equals_uncached_forward(kv_heads, split):
    model = tiny_model(num_key_value_heads=kv_heads)
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(tokens, "softmax", reference=True)
    state = model.init_state(batch=2, max_len=T, attention="softmax")
    parts = [model.step(tokens[:, :split], state)]
    parts += [model.step(tokens[:, t:t + 1], state) for t in range(split, T)]
    assert state.pos == T and state.seen.tolist() == [T, T]
    assert max_diff(torch.cat(parts, 1), ref) <= 1e-5


def test_prefill_blocks_continue_from_cache():
    model = tiny_model(num_key_value_heads=2)
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(tokens, "softmax", reference=True)
    state = model.init_state(1, T, "softmax")
    out = torch.cat([model.step(tokens[:, :5], state), model.step(tokens[:, 5:9], state),
                     model.step(tokens[:, 9:], state)], 1)
    assert max_diff(out, ref) <= 1e-5


def test_last_only_returns_last_position():
    model = tiny_model()
    tokens = torch.randint(0, 97, (2, 6))
    full = model.step(tokens, model.init_state(2, 8, "softmax"))
    last = model.step(tokens, model.init_state(2, 8, "softmax"), last_only=True)
    assert last.shape == (2, 1, 97)
    assert max_diff(last, full[:, -1:]) <= 1e-6


def test_masked_softmax_gives_exactly_zero_weight():
    """Future slots and pad slots get weight exactly 0: changing them changes nothing, bit for bit."""
    from engine.attention.softmax import softmax_attention_reference
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    valid = torch.tensor([[False, True, True, True, True]])
    out = softmax_attention_reference(q, k, v, valid)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 0], v2[:, :, 0] = 1e3, -1e3          # the pad slot
    out2 = softmax_attention_reference(q, k2, v2, valid)
    assert torch.equal(out[:, :, 1:], out2[:, :, 1:])
    k3, v3 = k.clone(), v.clone()
    k3[:, :, 4], v3[:, :, 4] = 1e3, 1e3           # a future slot for queries 0..3
    assert torch.equal(softmax_attention_reference(q, k3, v3, valid)[:, :, :4], out[:, :, :4])


def test_step_past_capacity_raises_and_leaves_state_intact():
    model = tiny_model()
    state = model.init_state(1, 4, "softmax")
    model.step(torch.tensor([[1, 2, 3]]), state)
    model.step(torch.tensor([[4]]), state)
    k_before = state.k.clone()
    with pytest.raises(ContextFullError, match="max_len 4"):
        model.step(torch.tensor([[5]]), state)
    assert state.pos == 4 and torch.equal(state.k, k_before)
    with pytest.raises(ContextFullError):
        model.step(torch.tensor([[1, 2, 3, 4, 5]]), model.init_state(1, 4, "softmax"))


def test_batch_mismatch_is_a_typed_error():
    model = tiny_model()
    state = model.init_state(2, 8, "softmax")
    with pytest.raises(StateMismatchError, match="batch size 3.*allocated for 2"):
        model.step(torch.zeros(3, 2, dtype=torch.long), state)


def test_unknown_attention_lists_valid_names():
    model = tiny_model()
    with pytest.raises(InvalidArgumentError, match="unknown attention 'flash'.*softmax, linear"):
        model.init_state(1, 8, attention="flash")
    with pytest.raises(InvalidArgumentError, match="softmax, linear"):
        model(torch.zeros(1, 2, dtype=torch.long), attention="cosine")


def test_kv_cache_bytes_follow_the_formula():
    model = tiny_model(num_key_value_heads=2)
    cfg = model.config
    state = model.init_state(3, 40, "softmax")
    assert state.nbytes == 2 * cfg.num_hidden_layers * 3 * cfg.num_key_value_heads * cfg.head_dim * 40 * 4
