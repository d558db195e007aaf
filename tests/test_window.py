"""Sliding window + linear (LoLCATs form): recurrence == chunked prefill == naive reference at every
split point, GQA, padded rows == each alone; the state is constant in the context."""
import pytest
import torch

from engine.attention.linear import CHUNK
from engine.attention.window import window_attention, window_linear_reference
from engine.attention.feature_maps import get_feature_map
from engine.steps import Stepper
from tests.conftest import (check_every_split, check_padded_pair_alone, native_after_prefill, prompt_and_follow,
                            tiny_model)


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


@pytest.mark.parametrize("W", [1, 5, CHUNK + 3], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T", [1, 9, 2 * CHUNK + 5], ids=lambda t: f"T{t}")
def test_chunked_equals_naive(W, T):
    g = torch.Generator().manual_seed(T * 31 + W)
    q, k, v = torch.randn(2, 4, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :T // 3] = False
    for fmap in ("elu1", "softmax"):
        fm = get_feature_map(fmap)
        assert max_diff(window_attention(q, k, v, fm, W, valid)[0], window_linear_reference(q, k, v, fm, W, valid)[0]) <= 1e-5
        a, b = window_attention(q, k, v, fm, W, valid)[1], window_linear_reference(q, k, v, fm, W, valid)[1]
        real = valid[1]
        assert max_diff(a[:, real], b[:, real]) <= 1e-5


def test_window_longer_than_sequence_is_softmax_attention():
    """With W >= T nothing leaves the window: exactly causal softmax attention."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    soft = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert max_diff(window_attention(q, k, v, get_feature_map("elu1"), 16), soft) <= 1e-5


@pytest.mark.parametrize("W,T", [(3, 10), (5, CHUNK + 9)], ids=["W3-T10", "W5-T73"])
def test_zero_map_is_sliding_window_attention_alone(W, T):
    """The zero feature map switches the linear branch off (the window-only ablation): each query attends
    with softmax scores to its last W keys and to nothing older, in the block form and in a model's
    prefill + one-token steps alike."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g) for _ in range(3))
    i = torch.arange(T)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
    zero = get_feature_map("zero")
    assert max_diff(window_attention(q, k, v, zero, W), want) <= 1e-5
    assert max_diff(window_linear_reference(q, k, v, zero, W), want) <= 1e-5
    assert max_diff(window_attention(q, k, v, get_feature_map("elu1"), W), want) > 1e-3   # the branch is on there
    model = tiny_model(num_key_value_heads=2, window=W)
    tokens = torch.randint(0, 97, (1, T), generator=g)
    with torch.no_grad():
        full = model(tokens, "linear", feature_map="zero")
    state = model.init_state(1, None, "linear", feature_map="zero")
    steps = torch.cat([model.step(tokens[:, :4], state)] + [model.step(tokens[:, t:t + 1], state) for t in range(4, T)], 1)
    assert max_diff(steps, full) <= 1e-5


@pytest.mark.parametrize("kv_heads,W", [(4, 3), (2, 16)], ids=["MHA-W3", "GQA-W16"])
def test_prefill_then_steps_equals_reference_at_every_split(kv_heads, W):
    model = tiny_model(num_hidden_layers=1, num_key_value_heads=kv_heads, window=W)
    T = CHUNK + 2
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(3))
    assert model.init_state(2, None, "linear").path == "window"

    def window_keys_equal(state, full):
        assert (state.wk - full.wk).abs().max().item() <= 1e-5
    check_every_split(model, tokens, per_split=window_keys_equal)


@pytest.mark.parametrize("backend", ["torch", "module"])
def test_padded_batch_equals_each_alone(backend):
    from engine.steps import Stepper
    model = tiny_model(num_key_value_heads=2, window=4, feature_map="softmax")
    step = Stepper(model, backend)
    check_padded_pair_alone(model, step, [5, 6, 7, 8, 9, 10, 11], [3, 4, 5], 6)


def test_state_is_constant_in_the_context():
    model = tiny_model(num_key_value_heads=2, window=8)
    state = model.init_state(1, None, "linear")
    before = state.nbytes
    model.step(torch.randint(0, 97, (1, 100)), state)
    for t in range(5):
        model.step(torch.tensor([[t]]), state)
    cfg = model.config
    D, Hkv, L = cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers
    assert state.nbytes == before == L * Hkv * ((D * D + D) * 4 + 2 * 8 * D * 4)


WINDOW_NATIVE = {
    "W3-MHA-elu1": dict(window=3, num_key_value_heads=4),
    "W1-GQA-cos1": dict(window=1, feature_map="cos1"),
    "W5-GQA-hedgehog": dict(window=5, feature_map="hedgehog"),
    "W4-hybrid-hedgehog": dict(window=4, feature_map="hedgehog", attention="hybrid", num_hidden_layers=3,
                               layer_attention=("linear", "softmax", "linear")),
    "W6-bf16": dict(window=6, dtype=torch.bfloat16),
}


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("case", WINDOW_NATIVE)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_native_step_equals_module_path(case, padded):
    """The native step runs window states (alone and in a hybrid): from one prefill, 12 steps past the
    window equal the module path, batch of 3. bf16: the window buffer in bf16 on both sides, the
    module path computing in bf16, so logits agree to bf16 rounding (3e-2, as test_native's 16-bit
    cache). Prompt blocks of window states of up to 64 tokens run natively too (test_sparse_keys)."""
    cfg = dict(WINDOW_NATIVE[case])
    dtype = cfg.pop("dtype", torch.float32)
    model = tiny_model(**{"attention": "linear", "num_key_value_heads": 2, **cfg}).to(dtype)
    prompt, real, follow = prompt_and_follow(11, padded)
    ref, fast, a, b = native_after_prefill(model, prompt, real, follow, 32)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert max_diff(a, b) <= tol
    first = next(iter(ref.state_dict()["tensors"]))   # the state's first tensor, as far as it is written
    want, got = ref.state_dict()["tensors"][first], fast.state_dict()["tensors"][first]
    assert max_diff(want, got) <= tol * (1 + want.abs().max().item())
    step = Stepper(model, "native", threads=2)
    assert step(prompt, model.init_state(3, 32), last_only=True) is not None and step.last_prefill_form == "native"


def test_gpu_block_length_gives_the_same_sums(monkeypatch):
    """On a GPU the stateless forms run blocks of GPU_CHUNK (fewer kernel launches); the block length
    changes only the order of the sums: both forms equal the reference with either length."""
    import types
    from engine.attention import linear as lin
    from engine.attention import window as win
    assert lin.stateless_chunk(types.SimpleNamespace(is_cuda=True)) == lin.GPU_CHUNK > CHUNK
    assert lin.stateless_chunk(torch.zeros(1)) == CHUNK
    g = torch.Generator().manual_seed(5)
    T, W = lin.GPU_CHUNK + 77, 37
    q, k, v = torch.randn(1, 4, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)
    fm = get_feature_map("elu1")
    for chunk in (CHUNK, lin.GPU_CHUNK):
        monkeypatch.setattr(win, "stateless_chunk", lambda x, c=chunk: c)
        monkeypatch.setattr(lin, "stateless_chunk", lambda x, c=chunk: c)
        assert max_diff(window_attention(q, k, v, fm, W), window_linear_reference(q, k, v, fm, W)) <= 1e-5
        ref = lin.linear_attention_reference(q, k, v, fm)[0]
        assert max_diff(lin.linear_attention(q, k, v, fm), ref) <= 1e-5
