"""The learned (hedgehog) feature map: recurrence == chunked prefill == naive form, every split, GQA, pads;
its parameters round-trip through safetensors; the native step declines it (the torch form runs it)."""
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
    model = tiny_model(seed=seed, feature_map="hedgehog", **cfg)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.hedgehog.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


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


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_decode_forms_equal_module_and_native_declines(backend):
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
        assert step.last_form == "torch"
    if backend == "auto" and step.fallback:
        assert "hedgehog" in step.fallback or "native" in step.fallback


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
