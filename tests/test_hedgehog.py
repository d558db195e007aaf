"""The learned (hedgehog) feature map: recurrence == chunked prefill == naive form, every split, GQA, pads;
its parameters round-trip through safetensors; the native step runs it as the module path does."""
import copy

import pytest
import torch

from engine.attention.feature_maps import FEATURE_MAPS, Hedgehog
from engine.attention.linear import CHUNK
from engine.errors import InvalidArgumentError
from engine.steps import Stepper
from models.errors import CheckpointError
from models.linearized import map_shapes, read_maps, write_maps
from tests.conftest import check_every_split, tiny_model


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def hedgehog_model(seed=0, **cfg):
    """A tiny model with random (far from identity) learned maps, different per layer and head."""
    return tiny_model(seed=seed, feature_map="hedgehog", **cfg)


def test_out_dim_and_state_bytes():
    model = hedgehog_model(num_key_value_heads=2)
    cfg = model.config
    assert FEATURE_MAPS["hedgehog"].out_dim(cfg.head_dim) == model.hedgehog.out_dim(cfg.head_dim) == 2 * cfg.head_dim
    state = model.init_state(2, None, "linear")
    F_ = 2 * cfg.head_dim
    assert state.nbytes == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (F_ * cfg.head_dim + F_) * 4


def test_maps_differ_per_layer_and_role():
    model = hedgehog_model()
    x = torch.randn(1, 4, 3, 16)
    hh = model.hedgehog
    assert max_diff(hh(x, 0, "q"), hh(x, 1, "q")) > 1e-3
    assert max_diff(hh(x, 0, "q"), hh(x, 0, "k")) > 1e-3


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_steps_equal_prefill_equal_naive_at_every_split(kv_heads):
    model = hedgehog_model(num_hidden_layers=1, num_key_value_heads=kv_heads)
    T = CHUNK + 6
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(3))
    check_every_split(model, tokens)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_decode_forms_equal_module(backend, request):
    if backend == "native":
        request.getfixturevalue("native_built")    # built, or skipped with the reason
    model = hedgehog_model(num_key_value_heads=2)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    ref, fast = model.init_state(1, None, "linear"), model.init_state(1, None, "linear")
    step = Stepper(model, backend)
    model.step(tokens[:, :4], ref)
    step(tokens[:, :4], fast)
    for i in range(4, 12):
        a = model.step(tokens[:, i:i + 1], ref)
        b = step(tokens[:, i:i + 1], fast)
        assert max_diff(a, b) <= 1e-5
        assert step.last_form == backend
    assert max_diff(ref.S, fast.S) <= 1e-5 * ref.S.abs().max().item()


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_native_batch_with_pads_equals_module(kv_heads, dtype):
    """Left-padded rows stepped natively (16-bit weights and maps read as they are, computed in
    fp32) against the module path in fp32 on the same values, from one fp32 prefill; auto picks the
    native step for learned maps."""
    model = hedgehog_model(num_key_value_heads=kv_heads).to(dtype)
    reference = copy.deepcopy(model).float()
    prompt = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(7))
    real = torch.ones(3, 6, dtype=torch.bool)
    real[1, :2] = real[2, :5] = False
    follow = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(8))
    ref, fast = reference.init_state(3, None, "linear"), model.init_state(3, None, "linear")
    a = [reference.step(prompt, ref, valid=real)[:, -1]]
    fast.load_state_dict(ref.state_dict())
    step, b = Stepper(model, "auto", threads=2), [a[0]]
    for t in follow.T:
        a.append(reference.step(t[:, None], ref)[:, -1])
        b.append(step(t[:, None], fast)[:, -1])
        assert step.last_form == "native", step.fallback
    assert max_diff(torch.stack(a), torch.stack(b)) <= 1e-4


def test_padded_batch_equals_each_alone():
    model = hedgehog_model(num_key_value_heads=2)
    a, b = [5, 6, 7, 8, 9, 10, 11], [3, 4, 5]
    batch = torch.tensor([a, [0] * 4 + b])
    real = torch.tensor([[True] * 7, [False] * 4 + [True] * 3])
    state = model.init_state(2, None, "linear")
    out = model.step(batch, state, valid=real)
    nxt = model.step(torch.tensor([[12], [13]]), state)
    for row, ids, tok in ((0, a, 12), (1, b, 13)):
        alone = model.init_state(1, None, "linear")
        o = model.step(torch.tensor([ids]), alone)
        n = model.step(torch.tensor([[tok]]), alone)
        assert max_diff(out[row, -1], o[0, -1]) <= 1e-5
        assert max_diff(nxt[row], n[0]) <= 1e-5


def test_maps_round_trip_through_safetensors_and_reject_another_model(tmp_path):
    model = hedgehog_model(num_key_value_heads=2)
    runtime = {f"hedgehog.{k}": v for k, v in model.hedgehog.state_dict().items()}
    write_maps(tmp_path / "maps.safetensors", runtime, dtype=torch.float32)
    back = read_maps(tmp_path / "maps.safetensors", model.config)
    assert set(back) == set(runtime) and all(torch.equal(back[k], runtime[k]) for k in runtime)
    assert set(map_shapes(model.config)) == {"feature_map.q.weight", "feature_map.q.bias",
                                             "feature_map.k.weight", "feature_map.k.bias"}
    with pytest.raises(CheckpointError, match="belong to another model"):
        read_maps(tmp_path / "maps.safetensors", model.config.replace(num_hidden_layers=3))


def test_registry_map_without_a_model_says_what_to_do():
    with pytest.raises(InvalidArgumentError, match="learned per layer"):
        FEATURE_MAPS["hedgehog"](torch.randn(1, 1, 2, 4), 0, "q")
    with pytest.raises(InvalidArgumentError, match="no learned"):
        tiny_model().init_state(1, None, "linear", feature_map="hedgehog")


def test_fresh_maps_are_identity_initialised():
    hh = Hedgehog(2, 3, 1, 4)
    assert torch.equal(hh.q_weight[1, 2], torch.eye(4)) and not hh.k_bias.any()


@pytest.mark.parametrize("window", [0, 8])
def test_attention_math_stays_fp32_under_bf16_autocast(window):
    """`gen linearize --finetune-dtype bfloat16` runs the model under autocast: the stateless linear
    and window forms must still compute the maps, sums and division in fp32 (in bf16 the finetune
    blew up), i.e. equal the fp32 form on the same bf16 inputs, rounded once at the end."""
    from engine.attention.linear import linear_attention
    from engine.attention.window import window_attention
    g = torch.Generator().manual_seed(0)
    fmap = Hedgehog(layers=1, heads=4, kv_heads=2, head_dim=16)
    with torch.no_grad():
        for t in (fmap.q_weight, fmap.k_weight):
            t.add_(torch.randn(t.shape, generator=g) * 0.3)
    q, k, v = (torch.randn(2, h, 40, 16, generator=g).bfloat16() for h in (4, 2, 2))
    run = (lambda q, k, v: window_attention(q, k, v, fmap, window, layer=0)) if window else \
        (lambda q, k, v: linear_attention(q, k, v, fmap, layer=0))
    want = run(q.float(), k.float(), v.float()).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(q, k, v)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
