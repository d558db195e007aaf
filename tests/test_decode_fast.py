"""The torch step form (engine.steps.torch_step) against the module path it replaces, token for token."""
import pytest
import torch

import engine.attention.softmax as softmax_mod
from engine.steps import Stepper
from tests.conftest import tiny_model

PROMPT, STEPS = 7, 6


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def run(model, path, tokens, fast, valid=None, fmap=None):
    """Prefill tokens[:, :PROMPT] (module path), then step the rest one at a time."""
    step = Stepper(model, "torch" if fast else "module")
    state = model.init_state(tokens.shape[0], tokens.shape[1], attention=path, feature_map=fmap)
    outs = [step(tokens[:, :PROMPT], state, valid=valid, last_only=True)]
    outs += [step(tokens[:, t:t + 1], state) for t in range(PROMPT, tokens.shape[1])]
    assert step.last_form == ("torch" if fast else "module")
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("path", ["softmax", "linear"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA2", "MQA"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_fast_step_equals_module_step(path, kv_heads, batch):
    model = tiny_model(num_key_value_heads=kv_heads)
    tokens = torch.randint(0, 97, (batch, PROMPT + STEPS), generator=torch.Generator().manual_seed(5))
    fast, s_fast = run(model, path, tokens, True)
    slow, s_slow = run(model, path, tokens, False)
    assert max_diff(fast, slow) <= 1e-5
    assert s_fast.pos == s_slow.pos and torch.equal(s_fast.seen, s_slow.seen)
    for a, b in zip(s_fast.tensors(), s_slow.tensors()):
        assert max_diff(a, b) <= 1e-5


def test_fast_step_matmul_attention_equals_sdpa(monkeypatch):
    """Past ONE_QUERY_MATMUL_FROM keys decode attention is two matmuls; force it from 0."""
    model = tiny_model(num_key_value_heads=2)
    tokens = torch.randint(0, 97, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(6))
    slow, _ = run(model, "softmax", tokens, False)
    monkeypatch.setattr(softmax_mod, "ONE_QUERY_MATMUL_FROM", 0)
    fast, _ = run(model, "softmax", tokens, True)
    assert max_diff(fast, slow) <= 1e-5


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_fast_step_after_left_padded_prompt(path):
    model = tiny_model()
    tokens = torch.randint(1, 97, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(7))
    valid = torch.ones(2, PROMPT, dtype=torch.bool)
    valid[1, :3] = False
    fast, _ = run(model, path, tokens, True, valid=valid)
    slow, _ = run(model, path, tokens, False, valid=valid)
    assert max_diff(fast, slow) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_step_half_precision(dtype):
    """addmm rounds once where linear-then-add rounds twice: equal up to half-precision rounding."""
    model = tiny_model(dtype=dtype)
    tokens = torch.randint(0, 97, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(8))
    fast, _ = run(model, "softmax", tokens, True)
    slow, _ = run(model, "softmax", tokens, False)
    assert fast.dtype == dtype and torch.isfinite(fast).all()
    assert max_diff(fast, slow) <= 0.05 * slow.float().abs().max().item()


def test_fast_step_without_rope():
    model = tiny_model(position_encoding="none")
    tokens = torch.randint(0, 97, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(9))
    fast, _ = run(model, "softmax", tokens, True)
    slow, _ = run(model, "softmax", tokens, False)
    assert max_diff(fast, slow) <= 1e-5


def test_plan_is_rebuilt_when_parameters_are_replaced():
    """load_state_dict(assign=True) swaps Parameter objects; the hoisted plan must follow."""
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    tok = torch.tensor([[3]])
    step = Stepper(model, "torch")
    step(tok, model.init_state(1, 4))                            # builds the plan
    model.load_state_dict(other.state_dict(), assign=True)
    got = step(tok, model.init_state(1, 4))
    want = other.step(tok, other.init_state(1, 4))
    assert max_diff(got, want) == 0.0
