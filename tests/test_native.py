"""The native C step form (engine.steps.native) against the module path, both attention paths."""
import pytest
import torch

from engine.errors import ContextFullError
from engine.steps import NativeStep, NativeUnavailableError, Stepper
from tests.conftest import tiny_model


@pytest.fixture(scope="module", autouse=True)
def built(tmp_path_factory):
    import os
    os.environ.setdefault("GEN_ENGINE_CACHE", str(tmp_path_factory.mktemp("native-cache")))
    from engine.steps.native import library
    try:
        library()
    except NativeUnavailableError as e:
        pytest.skip(f"native decode step unavailable here: {e}")


def run(model, prompt, follow, backend, max_len=64, attention="softmax", batch=1, fmap=None):
    """Prefill `prompt`, then step `follow` one token at a time; returns (logits, state, forms that ran)."""
    step = Stepper(model, backend)
    state = model.init_state(batch, max_len, attention, feature_map=fmap)
    out = [step(prompt, state)[:, -1:]]
    forms = set()
    for t in follow.T:
        out.append(step(t.view(batch, 1), state))
        forms.add(step.last_form)
    return torch.cat(out, 1), state, forms


CASES = {
    "MHA": {}, "GQA": {"num_key_value_heads": 2}, "untied": {"tie_word_embeddings": False},
    "no-rope": {"position_encoding": "none"}, "head_dim-12": {"head_dim": 12},
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_step_equals_module_step(case):
    model = tiny_model(**CASES[case])
    g = torch.Generator().manual_seed(1)
    prompt, follow = torch.randint(0, 97, (1, 5), generator=g), torch.randint(0, 97, (1, 40), generator=g)
    ref, s_ref, _ = run(model, prompt, follow, "module")
    got, s_got, forms = run(model, prompt, follow, "native")
    d = (ref - got).abs().max().item()
    dk = max((s_ref.k - s_got.k).abs().max().item(), (s_ref.v - s_got.v).abs().max().item())
    print(f"{case}: max |logit diff| {d:.2e}, max |cache diff| {dk:.2e}")
    assert d <= 1e-4 and dk <= 1e-5
    assert s_got.slots == s_ref.slots == 45 and int(s_got.lengths) == 45
    assert forms == {"native"}, "the native step did not run"


def test_native_greedy_tokens_equal_module():
    model = tiny_model(num_key_value_heads=2)
    outs = {}
    for backend in ("module", "native"):
        step, state = Stepper(model, backend), model.init_state(1, 60)
        tok, ids = torch.tensor([[1, 5, 9]]), []
        for _ in range(50):
            tok = step(tok, state)[:, -1:].argmax(-1)
            ids.append(int(tok))
        outs[backend] = ids
    assert outs["module"] == outs["native"]


@pytest.mark.parametrize("fmap", ["elu1", "relu", "softmax", "cos1"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_native_linear_step_equals_module_step(fmap, kv_heads):
    model = tiny_model(num_key_value_heads=kv_heads)
    g = torch.Generator().manual_seed(2)
    prompt, follow = torch.randint(0, 97, (1, 5), generator=g), torch.randint(0, 97, (1, 40), generator=g)
    ref, s_ref, _ = run(model, prompt, follow, "module", attention="linear", fmap=fmap)
    got, s_got, forms = run(model, prompt, follow, "native", attention="linear", fmap=fmap)
    d = (ref - got).abs().max().item()
    dS = (s_ref.S - s_got.S).abs().max().item() / s_ref.S.abs().max().item()
    dz = (s_ref.z - s_got.z).abs().max().item() / s_ref.z.abs().max().item()
    print(f"{fmap}: max |logit diff| {d:.2e}, relative S {dS:.2e}, z {dz:.2e}")
    assert d <= 1e-4 and dS <= 1e-5 and dz <= 1e-5
    assert forms == {"native"}, "the native step did not run"


@pytest.mark.parametrize("case", ["batch2", "bf16"])
def test_other_cases_fall_back_to_torch(case):
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    model = tiny_model(dtype=dtype)
    batch = 2 if case == "batch2" else 1
    prompt, follow = torch.randint(0, 97, (batch, 4)), torch.randint(0, 97, (batch, 6))
    ref, _, _ = run(model, prompt, follow, "torch", batch=batch)
    got, _, forms = run(model, prompt, follow, "native", batch=batch)
    assert torch.equal(ref, got) and forms == {"torch"}


def test_fallback_reason_is_kept():
    model = tiny_model(dtype=torch.bfloat16)
    step = Stepper(model, "auto")
    state = model.init_state(1, 8)
    step(torch.tensor([[1, 2]]), state)
    step(torch.tensor([[3]]), state)
    assert step.last_form == "torch" and "fp32" in step.fallback


def test_native_step_past_the_cache_raises():
    model = tiny_model()
    step = Stepper(model, "native")
    state = model.init_state(1, 4, "softmax")
    step(torch.tensor([[1, 2, 3]]), state)
    step(torch.tensor([[4]]), state)
    assert step.last_form == "native"
    with pytest.raises(ContextFullError):
        step(torch.tensor([[5]]), state)
    assert state.slots == 4


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_native_step_after_storage_is_replaced(attention):
    """PITFALLS #20: model.half().float() frees the weights' storage and allocates new; a native plan
    still holding the old pointers reads freed memory (NaN logits). Every step re-checks them."""
    model = tiny_model(num_key_value_heads=2)
    native = NativeStep(model)
    state = model.init_state(1, 16, attention)
    model.step(torch.tensor([[1, 2, 3, 4, 5]]), state)
    for t in (6, 7, 8):
        native(torch.tensor([[t]]), state)
    model.half().float()
    junk = [torch.full((n,), 1e30) for n in (97 * 64, 64 * 96 * 2, 64 * 64 * 3)]   # reuse freed memory
    fresh = model.init_state(1, 16, attention)
    for a, b in zip(fresh.tensors(), state.tensors()):
        a.copy_(b)
    fresh.slots, fresh.lengths = state.slots, state.lengths.clone()
    got = native(torch.tensor([[9]]), state)
    want = model.step(torch.tensor([[9]]), fresh)
    del junk
    d = (got - want).abs().max().item()
    print(f"{attention}: max |logit diff| after half().float() {d:.2e}")
    assert torch.isfinite(got).all() and d <= 1e-4
