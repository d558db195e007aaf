"""Hybrid layers: listed layers keep a KV cache, the rest are linear RNNs, in one state object.
prefill + steps == full forward at every split; padded batch == each alone; state bytes == the
per-layer formula; bad layer lists are one clear error."""
import pytest
import torch

from engine.attention.hybrid import HybridState, parse_softmax_layers, state_bytes
from engine.errors import InvalidArgumentError
from engine.steps import Stepper
from models.errors import ConfigError
from tests.conftest import module_and_native_steps, prompt_and_follow, tiny_model


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |diff| = {d:.3e}")
    return d


def hybrid_model(layers=("softmax", "linear", "linear"), window=0, **cfg):
    return tiny_model(num_hidden_layers=len(layers), num_key_value_heads=2, attention="hybrid",
                      layer_attention=layers, window=window, **cfg)


def test_hybrid_forward_mixes_the_two_paths():
    """A hybrid forward differs from both all-softmax and all-linear, and equals its reference twin."""
    model = hybrid_model()
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hyb, ref = model(tokens), model(tokens, reference=True)
        soft, lin = model(tokens, "softmax"), model(tokens, "linear")
    assert max_diff(hyb, ref) <= 1e-5
    assert max_diff(hyb, soft) > 1e-3 and max_diff(hyb, lin) > 1e-3


@pytest.mark.parametrize("window", [0, 4], ids=["linear", "window4"])
def test_prefill_then_steps_equals_full_forward_at_every_split(window):
    model = hybrid_model(("linear", "softmax"), window=window)
    T = 24     # chunk edges are covered per path (test_core_linear, test_window); here: every split of the mix
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
    worst = 0.0
    for t in range(1, T):
        state = model.init_state(2)
        assert isinstance(state, HybridState)
        outs = [model.step(tokens[:, :t], state)] + [model.step(tokens[:, i:i + 1], state) for i in range(t, T)]
        worst = max(worst, (torch.cat(outs, 1) - full).abs().max().item())
    print(f"max |diff| = {worst:.3e}")
    assert worst <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "auto", "module"])
def test_decode_forms_equal_module_path(backend):
    model = hybrid_model(("linear", "softmax", "linear"))
    step = Stepper(model, backend)
    tokens = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    ref, fast = model.init_state(1), model.init_state(1)
    model.step(tokens[:, :3], ref)
    step(tokens[:, :3], fast)
    for i in range(3, 10):
        assert max_diff(model.step(tokens[:, i:i + 1], ref), step(tokens[:, i:i + 1], fast)) <= 1e-5
        assert step.last_form == backend or (backend == "auto" and step.last_form in ("native", "torch"))


HYBRID_NATIVE = {
    "hedgehog": dict(layers=("linear", "softmax", "linear"), feature_map="hedgehog"),
    "elu1-no-linear-rope": dict(layers=("softmax", "linear"), linear_rope=False),
    "softmax-last-MHA": dict(layers=("linear", "linear", "softmax"), feature_map="cos1", num_key_value_heads=4),
}


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("case", HYBRID_NATIVE)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_native_step_equals_module_path(case, padded):
    """The native step runs the per-layer mix (KV cache and linear state in one plan, rotary per
    layer, learned maps per model layer): prompt and 12 steps equal the module path, batch of 3."""
    cfg = dict(HYBRID_NATIVE[case])
    model = tiny_model(num_hidden_layers=len(cfg["layers"]), attention="hybrid",
                       layer_attention=cfg.pop("layers"), **{"num_key_value_heads": 2, **cfg})
    prompt, real, follow = prompt_and_follow(9, padded)
    step = Stepper(model, "native", threads=2)
    ref, fast = model.init_state(3, 32), model.init_state(3, 32)
    first = model.step(prompt, ref, valid=real)[:, -1:], step(prompt, fast, valid=real, last_only=True)[:, -1:]
    assert step.last_prefill_form == "native"   # a padded block: row by row, each on the pool
    a, b = module_and_native_steps(model, step, ref, fast, follow)
    assert max_diff(torch.cat([first[0], a], 1), torch.cat([first[1], b], 1)) <= 1e-4


def test_rotary_per_layer_when_linear_layers_skip_it():
    """linear_rope=False: softmax layers rotate, linear layers do not; step == forward."""
    model = hybrid_model(("softmax", "linear"), linear_rope=False)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(tokens)
    state = model.init_state(1)
    outs = [model.step(tokens[:, :5], state)] + [Stepper(model, "torch")(tokens[:, i:i + 1], state) for i in range(5, 12)]
    assert max_diff(torch.cat(outs, 1), full) <= 1e-5


def test_padded_batch_equals_each_alone():
    model = hybrid_model()
    a, b = [5, 6, 7, 8, 9, 10, 11], [3, 4, 5]
    state = model.init_state(2)
    out = model.step(torch.tensor([a, [0] * 4 + b]), state, valid=torch.tensor([[True] * 7, [False] * 4 + [True] * 3]))
    nxt = [model.step(torch.tensor([[12 + i], [20 + i]]), state) for i in range(3)]
    for row, ids, base in ((0, a, 12), (1, b, 20)):
        alone = model.init_state(1)
        assert max_diff(out[row, -1], model.step(torch.tensor([ids]), alone)[0, -1]) <= 1e-5
        for i in range(3):
            assert max_diff(nxt[i][row], model.step(torch.tensor([[base + i]]), alone)[0]) <= 1e-5


@pytest.mark.parametrize("window", [0, 6])
def test_state_bytes_equal_the_per_layer_formula(window):
    layers = ("softmax", "linear", "linear", "softmax")
    model = hybrid_model(layers, window=window)
    state = model.init_state(2, max_len=40)
    assert state.nbytes == state_bytes(model.config, layers, 40, batch=2, dtype_bytes=4, window=window)
    kv = model.init_state(2, max_len=40, attention="softmax").nbytes
    lin = model.init_state(2, max_len=40, attention="linear").nbytes
    assert state.nbytes == (kv + lin) // 2 if not window else state.nbytes > kv // 2


def test_softmax_layers_parsing_and_errors():
    cfg = tiny_model(num_hidden_layers=4).config
    assert parse_softmax_layers("1,3", cfg) == ("linear", "softmax", "linear", "softmax")
    with pytest.raises(InvalidArgumentError, match="softmax layer 99 does not exist; the model has 4 layers"):
        parse_softmax_layers("99", cfg)
    with pytest.raises(InvalidArgumentError, match="needs the transfer losses"):
        parse_softmax_layers("auto:2", cfg)
    with_losses = cfg.replace(transfer_loss=(0.1, 0.5, 0.05, 0.3))
    assert parse_softmax_layers("auto:2", with_losses) == ("linear", "softmax", "linear", "softmax")
    with pytest.raises(ConfigError, match="layer_attention must list 4 entries"):
        cfg.replace(attention="hybrid", layer_attention=("softmax",))
    with pytest.raises(ConfigError, match="window must be a non-negative integer"):
        cfg.replace(window=-1)
