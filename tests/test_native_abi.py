"""The native step's faces (issue 31 item 3): the ctypes mirror of gen.h (structs, and the block kinds'
type codes) checked against the compiled library when it binds, the weight copies owned by the step
(nothing hung on the model), and the test switches as constructor options."""
import ctypes
import gc

import pytest
import torch

from engine.quant import quantize_model
from engine.steps import Stepper
from engine.steps.native import NativeABIError, NativeStep, NativeUnavailableError, abi, bind
from engine.steps.native.weights import DerivedWeights
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("native_built")   # tests/conftest.py: built, or skipped with the reason


def test_mirror_matches_the_library_field_for_field():
    """The check is live: C reports every field the mirror has, at the mirror's offsets."""
    lib = bind()
    assert abi.layout_problems(lib) == []
    for s, cls in enumerate((abi.Mat, abi.Plan)):
        size, fields = abi._c_layout(lib, s)
        assert size == ctypes.sizeof(cls)
        assert list(fields) == [n for n, *_ in cls._fields_]


def test_block_kinds_match_the_library():
    """gen.h's type codes and block bytes of every block kind (gen_abi's table 2) are TYPES' and
    engine.quant's; a kind renumbered or missing on the Python side is one clear NativeABIError."""
    lib = bind()
    kinds = abi._c_kinds(lib)
    assert abi.kind_problems(lib) == [] and set(kinds) == {k for k in abi.TYPES if isinstance(k, str)}
    assert kinds["q5_0"] == (11, 22) and kinds["q5_1"] == (12, 24) and kinds["q4_1"] == (5, 20)
    swapped = {**abi.TYPES, "q5_0": 12, "q5_1": 11}
    with pytest.raises(NativeABIError, match="block kind q5_0 is type 11 of 22-byte blocks in gen.h, type 12 of 22 here"):
        abi.check_layout(lib, types=swapped)
    fewer = {k: v for k, v in abi.TYPES.items() if k != "q5_1"}
    with pytest.raises(NativeABIError, match="block kind q5_1 is missing here"):
        abi.check_layout(lib, types=fewer)


def test_bind_checks_the_kinds_again_when_they_change(monkeypatch):
    """A library already bound is checked again once TYPES differs from the table it was bound with."""
    bind()
    monkeypatch.setitem(abi.TYPES, "q5_0", 12)
    with pytest.raises(NativeABIError, match="block kind q5_0"):
        bind()
    monkeypatch.undo()
    assert abi.layout_problems(bind()) == []


def _plan_without(name: str, retype=None):
    """abi.Plan with field `name` dropped, or given ctypes type `retype`."""
    fields = [(n, retype or t) if n == name else (n, t) for n, t in abi.Plan._fields_ if retype or n != name]
    return type("Plan", (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize("field, retype, says", [
    ("q8_acts", None, "Plan.q8_acts is missing here"),
    ("tscratch_floats", ctypes.c_int, "Plan.tscratch_floats at byte"),   # 8 bytes in C, 4 here: every later field moves
])
def test_a_mirror_that_disagrees_with_gen_h_is_one_clear_error(monkeypatch, field, retype, says):
    """A field dropped from (or retyped in) the ctypes Plan: binding raises NativeABIError naming the
    field and the file to fix, before any plan is filled; the auto backend falls back to torch with
    that reason, the native backend raises it; the true mirror binds again."""
    monkeypatch.setattr(abi, "Plan", _plan_without(field, retype))
    with pytest.raises(NativeABIError) as e:
        bind()
    msg = str(e.value)
    assert says in msg and "engine/steps/native/abi.py" in msg and "\n" not in msg
    assert isinstance(e.value, NativeUnavailableError)
    model = tiny_model()
    with pytest.raises(NativeABIError):
        NativeStep(model)
    with pytest.raises(NativeABIError):
        Stepper(model, "native")
    auto = Stepper(model, "auto")
    assert auto.forms_available == ["torch"] and says in auto.fallback
    monkeypatch.undo()
    assert abi.layout_problems(bind()) == []
    assert Stepper(model, "auto").forms_available == ["native", "torch"]


def _all_attributes(model) -> dict:
    return {name: set(vars(m)) for name, m in model.named_modules()}


@pytest.mark.parametrize("weights", ["exact16", "q8_0"])
def test_native_step_hangs_nothing_on_the_model(weights):
    """Building and running a NativeStep (prompt block on the pool, then steps) adds no attribute to
    the model or any of its modules: the 16-bit copies and regrouped blocks live on the step (a
    module's own q4_1 / q8_0 blocks may be held grouped: the same attributes, tests/test_gguf.py)."""
    model = tiny_model(num_key_value_heads=2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())      # fp32 weights of f16 values: the plan reads 16-bit copies
    if weights == "q8_0":
        quantize_model(model, "q8_0")
    model.rotary.table(64, model.device, torch.float32)   # the model's own rotary cache, grown before
    before = _all_attributes(model)
    step = NativeStep(model, threads=2, activations="q8")
    state = model.init_state(2, 32)
    step.prefill(torch.tensor([[1, 2, 3], [4, 5, 6]]), state)
    step(torch.tensor([[7], [8]]), state)
    assert _all_attributes(model) == before
    assert step.weights._cache   # the copies exist, on the step
    if weights == "exact16":
        assert step.weights_read() == "float16"


def test_exact16_and_regroup_are_constructor_options():
    """NativeStep(exact16=False) reads the fp32 tensors, (regroup=False) the q8_0 blocks as stored;
    either way the same logits (exact16) or greedy ids (regroup) as the defaults."""
    model = tiny_model(num_key_value_heads=2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    prompt, follow = torch.tensor([[1, 5, 9, 2]]), [3, 7, 11]

    def run(step):
        state = model.init_state(1, 16)
        out = [step.prefill(prompt, state)]
        out += [step(torch.tensor([[t]]), state) for t in follow]
        return torch.cat(out, 1), step.plans[state].tables["qkv"][0].type

    (on, t_on), (off, t_off) = run(NativeStep(model, threads=2)), run(NativeStep(model, threads=2, exact16=False))
    assert (t_on, t_off) == (1, 0)   # gen.h T_F16, T_F32
    assert torch.equal(on, off)
    quantize_model(model, "q8_0")
    grouped, stored = NativeStep(model, threads=2, activations="q8"), NativeStep(model, threads=2, activations="q8",
                                                                                 regroup=False)
    (g, t_g), (s, t_s) = run(grouped), run(stored)
    assert t_s == 3 and t_g == (7 if grouped.library.gen_has_q4_1r() else 3)   # T_Q8_0, T_Q8_0R
    assert torch.equal(g.argmax(-1), s.argmax(-1))


def test_a_copy_is_forgotten_with_its_weight():
    """The cache holds no strong reference to a weight and drops its copy when the weight dies."""
    copies = DerivedWeights()
    w = torch.randn(8, 8).half().float()
    assert copies.exact16(w).dtype == torch.float16 and len(copies._cache) == 1
    assert copies.exact16(w) is copies.exact16(w)   # made once
    del w
    gc.collect()
    assert copies._cache == {}


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_fp32_prompt_blocks_read_the_regrouped_blocks_as_the_stored_ones(kind):
    """Under f32-prompt, prompt blocks multiply fp32 activations by the regrouped copies (kernels.c
    decodes T_Q8_0R / T_Q4_1R), the step keeps no table of the blocks as stored, and the prompt's
    logits equal, bit for bit, those of the blocks as stored (regroup=False)."""
    model = tiny_model(num_key_value_heads=2)
    quantize_model(model, kind)
    prompt = torch.tensor([[1, 5, 9, 2, 4, 6, 8]])

    def run(step):
        state = model.init_state(1, 16)
        out = step.prefill(prompt, state)
        return out, step.plans[state].tables["wo"][0].type

    grouped = NativeStep(model, threads=2, activations="f32-prompt")
    if not grouped.library.gen_has_q4_1r():
        pytest.skip("this build has no regrouped kernels (AVX-512 VNNI)")
    (g, t_g), (s, t_s) = run(grouped), run(NativeStep(model, threads=2, activations="f32-prompt", regroup=False))
    assert t_g == {"q8_0": 7, "q4_1": 6}[kind] and t_s == {"q8_0": 3, "q4_1": 5}[kind]   # gen.h T_*R, T_*
    assert torch.equal(g, s)
