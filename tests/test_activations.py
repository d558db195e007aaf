"""What quantized weights multiply in the native step (`activations`): "f32" is PyTorch's arithmetic
(the blocks decoded in the dots, the activations as they are), "q8" is llama.cpp's (activations
rounded to q8 blocks, integer dots), "f32-prompt" (the default) reads prompt blocks as "f32" and
decodes as "q8". On a random model with SmolLM2's widths and q4_1 / q8_0 blocks."""
from __future__ import annotations

import pytest
import torch

from engine import load
from engine.errors import InvalidArgumentError
from engine.quant import quantize_model
from engine.steps import DEFAULT_ACTIVATIONS, Stepper
from tests.conftest import check_rows_alone, tiny_model

pytestmark = pytest.mark.usefixtures("native_built")   # tests/conftest.py: built, or skipped with the reason

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
             vocab_size=160, max_position_embeddings=64, num_hidden_layers=2)
PROMPT = torch.randint(3, 160, (1, 19), generator=torch.Generator().manual_seed(1))


def model_of(kind: str):
    model = tiny_model(seed=5, **SHAPE)
    assert quantize_model(model, kind) == []
    return model


def diff(a, b) -> float:
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |logit diff| = {d:.2e}")
    return d


def prefill_then_steps(step, model, n=3, path="softmax"):
    """Logits of the prompt block, then of n decode steps (greedy), through `step`."""
    state = model.init_state(1, 40, path)
    out = [step(PROMPT, state, last_only=True)[:, -1]]
    for _ in range(n):
        out.append(step(out[-1].argmax(-1, keepdim=True), state)[:, -1])
    return torch.stack(out), state


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_f32_activations_are_pytorchs_arithmetic(kind, path):
    model = model_of(kind)
    native = Stepper(model, "native", activations="f32")
    torch_ = Stepper(model, "torch")
    ours, _ = prefill_then_steps(native, model, path=path)
    ref, _ = prefill_then_steps(torch_, model, path=path)
    assert native.last_form == "native" and native.last_prefill_form == "native"
    assert diff(ours, ref) < 1e-4
    q8, _ = prefill_then_steps(Stepper(model, "native", activations="q8"), model, path=path)
    assert diff(q8, ref) > 1e-4          # the other arithmetic: the test above can tell them apart


def test_f32_prompt_reads_the_prompt_in_f32_and_decodes_in_q8():
    model = model_of("q4_1")
    mixed = Stepper(model, "native", activations="f32-prompt")
    f32, q8 = Stepper(model, "native", activations="f32"), Stepper(model, "native", activations="q8")
    state = model.init_state(1, 40, "softmax")
    first = mixed(PROMPT, state, last_only=True)[:, -1]
    assert diff(first, f32(PROMPT, model.init_state(1, 40, "softmax"), last_only=True)[:, -1]) < 1e-5
    tok = first.argmax(-1, keepdim=True)
    twin = model.init_state(1, 40, "softmax")
    twin.load_state_dict(state.state_dict())
    assert torch.equal(mixed(tok, state), q8(tok, twin))     # the decode step is q8's, bit for bit


def test_f32_rows_are_the_same_in_a_batch():
    model = model_of("q4_1")
    step = Stepper(model, "native", activations="f32")
    check_rows_alone(step, model, PROMPT, torch.randint(3, 160, (3, 1), generator=torch.Generator().manual_seed(2)))


def test_bad_activations_is_one_line():
    with pytest.raises(InvalidArgumentError, match="activations must be one of"):
        load("tiny", activations="int4")
    assert DEFAULT_ACTIVATIONS == "f32-prompt" and load("tiny").step.activations == DEFAULT_ACTIVATIONS
