"""A KV cache in another dtype than the weights (load(kv_dtype=...), --kv-dtype): float16 under fp32
weights, as llama.cpp keeps its cache. Every step form reads the same rounded keys and values."""
import dataclasses

import pytest
import torch

from engine import load
from engine.bench.memory import config_state_bytes
from engine.errors import InvalidArgumentError
from engine.steps import Stepper
from tests.conftest import prompt_and_follow, tiny_model


def steps_on_one_cache(model, step, ref, fast, follow):
    """module_and_native_steps, each step on the same rounded cache. An f16 cache rounds every key and
    value once; where the forms' fp32 keys differ in the last bit (the native step's sums are not
    PyTorch's: exact on AVX-512 builds, ~1e-7 apart on AVX2 ones) a few entries round to neighbouring
    f16 values, and one such key moves later logits by ~1e-4. So before each step the module's state
    takes the native one's 16-bit tensors, after checking that every entry is within 4 f16 ulps
    (2^-8 relative) or 1e-5 (near zero) of it: a rounding flip, and what a flipped key of layer l does
    to the keys of layer l + 1 in the same step (measured: 2 ulps), never a wrong value.
    Returns both logits (B, N, V) and whether every cache entry was that close."""
    a, b, close = [], [], True
    for t in follow.T:
        for x, y in zip(ref.tensors(), fast.tensors()):
            if x.dtype == torch.float16:   # the slots written (a CPU cache's others are unwritten memory)
                n = ref.slots
                close &= torch.allclose(x[..., :n, :].float(), y[..., :n, :].float(), rtol=2 ** -8, atol=1e-5)
                x.copy_(y)
        a.append(model.step(t[:, None], ref))
        b.append(step(t[:, None], fast))
        assert step.last_form == "native", step.fallback
    return torch.cat(a, 1), torch.cat(b, 1), close


@pytest.mark.parametrize("attention", ["softmax", "hybrid"])
def test_f16_cache_under_fp32_weights_every_form_agrees(native_built, attention):
    model = tiny_model(num_key_value_heads=2)
    if attention == "hybrid":
        model.config = model.config.replace(attention="hybrid", layer_attention=("softmax", "linear"))
    spec = dataclasses.replace(model.run_spec(), kv_dtype=torch.float16)   # the run's, not a model attribute
    prompt, real, follow = prompt_and_follow(3, padded=True)
    ref, fast = model.init_state(3, 32, spec=spec), model.init_state(3, 32, spec=spec)
    kv = ref if ref.path == "softmax" else ref.parts[0]
    assert kv.path == "softmax" and kv.k.dtype == kv.v.dtype == torch.float16
    if attention == "hybrid":
        assert ref.parts[1].S.dtype == torch.float32             # the linear part keeps its fp32 state
    model.step(prompt, ref, valid=real)
    step = Stepper(model, "auto", threads=2)
    step(prompt, fast, valid=real)
    want, got, close = steps_on_one_cache(model, step, ref, fast, follow)
    d = (want - got).abs().max().item()
    print(f"{attention}: native vs module with an f16 cache: {d:.1e}")
    assert d <= 1e-4 and torch.equal(want.argmax(-1), got.argmax(-1))
    assert close, "the native step's f16 cache holds other values than the module's"
    # the PyTorch step against the module path, each on its own cache (both round with PyTorch's sums)
    torch_step, third, plain = Stepper(model, "torch"), model.init_state(3, 32), model.init_state(3, 32)
    model.step(prompt, third, valid=real)
    model.step(prompt, plain, valid=real)
    via_torch = torch.cat([torch_step(t[:, None], third) for t in follow.T], 1)
    via_module = torch.cat([model.step(t[:, None], plain) for t in follow.T], 1)
    assert torch_step.last_form == "torch" and (via_torch - via_module).abs().max().item() <= 1e-4
    fp32 = model.init_state(3, 32, kv_dtype=torch.float32)
    assert fast.nbytes == config_state_bytes(model.config, 32, torch.float32, batch=3, kv_dtype=torch.float16)
    assert fast.nbytes < fp32.nbytes


def test_api_kv_dtype_and_bad_values(small_model_dir):
    llm = load(str(small_model_dir), kv_dtype="float16")
    state = llm.model.init_state(1, 8)
    assert all(t.dtype == torch.float16 for t in state.tensors())
    assert llm.generate("the cat", max_new_tokens=4, temperature=0).text is not None
    with pytest.raises(InvalidArgumentError, match="unknown dtype 'f8'"):
        load(str(small_model_dir), kv_dtype="f8")


def test_saved_f16_cache_loads_where_the_cache_is_f16(small_model_dir, tmp_path):
    """A saved state records its cache's dtype: it loads into a model keeping that cache dtype and is
    refused, in one line naming kv_dtype, by one keeping another."""
    from engine.errors import StateMismatchError
    llm = load(str(small_model_dir), kv_dtype="float16")
    path = tmp_path / "s.safetensors"
    llm.save_state(path, llm.prefill("the cat sat"))
    saved = llm.load_state(path)
    want = llm.generate("the cat sat", max_new_tokens=5, temperature=0).ids
    assert llm.resume(saved, max_new_tokens=5, temperature=0).run()[0].ids == want
    with pytest.raises(StateMismatchError, match="kv_dtype=float16"):
        load(str(small_model_dir)).load_state(path)
