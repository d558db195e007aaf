"""The native C decode step (engine.native) against the PyTorch step it replaces, both paths."""
import pytest
import torch

from engine.errors import ContextFullError
from tests.conftest import tiny_model


@pytest.fixture(scope="module", autouse=True)
def built(tmp_path_factory):
    import os
    os.environ.setdefault("GEN_ENGINE_CACHE", str(tmp_path_factory.mktemp("native-cache")))
    from engine.native import NativeUnavailableError, library
    try:
        library()
    except NativeUnavailableError as e:
        pytest.skip(f"native decode step unavailable here: {e}")


def run(model, prompt, follow, native, max_len=64, attention="softmax", batch=1):
    model.native_decode = native
    state = model.init_state(batch, max_len, attention)
    out = [model.step(prompt, state)[:, -1:]]
    out += [model.step(t.view(batch, 1), state) for t in follow.T]
    model.native_decode = False
    return torch.cat(out, 1), state


CASES = {
    "MHA": {}, "GQA": {"num_key_value_heads": 2}, "untied": {"tie_word_embeddings": False},
    "no-rope": {"position_encoding": "none"}, "head_dim-12": {"head_dim": 12},
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_step_equals_torch_step(case):
    model = tiny_model(**CASES[case])
    g = torch.Generator().manual_seed(1)
    prompt, follow = torch.randint(0, 97, (1, 5), generator=g), torch.randint(0, 97, (1, 40), generator=g)
    ref, s_ref = run(model, prompt, follow, native=False)
    got, s_got = run(model, prompt, follow, native=True)
    d = (ref - got).abs().max().item()
    dk = max((s_ref.k - s_got.k).abs().max().item(), (s_ref.v - s_got.v).abs().max().item())
    print(f"{case}: max |logit diff| {d:.2e}, max |cache diff| {dk:.2e}")
    assert d <= 1e-4 and dk <= 1e-5
    assert s_got.pos == s_ref.pos == 45 and int(s_got.seen) == 45
    assert getattr(s_got, "_native", None) is not None, "the native step did not run"


def test_native_greedy_tokens_equal_torch():
    model = tiny_model(num_key_value_heads=2)
    from engine.bench.hf_compare import greedy_step_loop
    ref = greedy_step_loop(model, [1, 5, 9], 50)
    model.native_decode = True
    got = greedy_step_loop(model, [1, 5, 9], 50)
    model.native_decode = False
    assert torch.equal(ref, got)


@pytest.mark.parametrize("fmap", ["elu1", "relu", "softmax", "cos1"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_native_linear_step_equals_torch_step(fmap, kv_heads):
    model = tiny_model(num_key_value_heads=kv_heads)
    g = torch.Generator().manual_seed(2)
    prompt, follow = torch.randint(0, 97, (1, 5), generator=g), torch.randint(0, 97, (1, 40), generator=g)
    states = {}
    for native in (False, True):
        model.native_decode = native
        state = states[native] = model.init_state(1, None, "linear", feature_map=fmap)
        out = [model.step(prompt, state)[:, -1:]] + [model.step(t.view(1, 1), state) for t in follow.T]
        states[native, "out"] = torch.cat(out, 1)
    model.native_decode = False
    d = (states[False, "out"] - states[True, "out"]).abs().max().item()
    dS = (states[False].S - states[True].S).abs().max().item() / states[False].S.abs().max().item()
    dz = (states[False].z - states[True].z).abs().max().item() / states[False].z.abs().max().item()
    print(f"{fmap}: max |logit diff| {d:.2e}, relative S {dS:.2e}, z {dz:.2e}")
    assert d <= 1e-4 and dS <= 1e-5 and dz <= 1e-5
    assert getattr(states[True], "_native", None) is not None, "the native step did not run"


@pytest.mark.parametrize("case", ["batch2", "bf16"])
def test_other_cases_fall_back_to_torch(case):
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    model = tiny_model(dtype=dtype)
    batch = 2 if case == "batch2" else 1
    attention = "softmax"
    prompt, follow = torch.randint(0, 97, (batch, 4)), torch.randint(0, 97, (batch, 6))
    ref, _ = run(model, prompt, follow, False, attention=attention, batch=batch)
    got, state = run(model, prompt, follow, True, attention=attention, batch=batch)
    assert torch.equal(ref, got) and getattr(state, "_native", None) is None


def test_native_step_past_the_cache_raises():
    model = tiny_model()
    model.native_decode = True
    state = model.init_state(1, 4, "softmax")
    model.step(torch.tensor([[1, 2, 3]]), state)
    model.step(torch.tensor([[4]]), state)
    with pytest.raises(ContextFullError):
        model.step(torch.tensor([[5]]), state)
    assert state.pos == 4
