"""Prompt blocks on the native step (NativeStep.prefill: the block's tokens as the rows of one
batched step on the thread pool) against the module path's prefill: last-position logits, the
state it leaves (the steps after it), both attention paths, GQA, blocks longer than PREFILL_ROWS,
prefill after prefill, threads, and the cases that stay on the module path (pads)."""
import pytest
import torch

from engine.quant import quantize_model
from engine.steps import NativeUnavailableError, Stepper
from engine.steps.native import PREFILL_ROWS
from tests.conftest import tiny_model


pytestmark = pytest.mark.usefixtures("native_built")   # tests/conftest.py: built, or skipped with the reason


def ids(seed, batch, n):
    return torch.randint(0, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def prefill_then_steps(model, backend, blocks, follow, attention="softmax", fmap=None, threads=2, max_len=None):
    """Prefill each block of `blocks` (B, T_i) in turn (last_only), then step `follow` (B, N) one token
    at a time. Returns (logits (B, len(blocks) + N, V), the forms that ran the blocks)."""
    B = blocks[0].shape[0]
    step = Stepper(model, backend, threads=threads)
    state = model.init_state(B, max_len or sum(b.shape[1] for b in blocks) + follow.shape[1] + 1, attention,
                             feature_map=fmap)
    out, forms = [], []
    for block in blocks:
        out.append(step(block, state, last_only=True))
        forms.append(step.last_prefill_form)
    for t in follow.T:
        out.append(step(t.reshape(B, 1), state))
    return torch.cat(out, 1), forms


CASES = {
    "softmax-T5-B1": dict(T=5, B=1),
    "softmax-T150-B2": dict(T=PREFILL_ROWS * 2 + 22, B=2),
    "softmax-GQA-T70": dict(T=PREFILL_ROWS + 6, B=1, cfg={"num_key_value_heads": 2}),
    "softmax-no-rope-T9": dict(T=9, B=2, cfg={"position_encoding": "none"}),
    "linear-elu1-T70-B2": dict(T=PREFILL_ROWS + 6, B=2, attention="linear", fmap="elu1"),
    "linear-relu-T9": dict(T=9, B=1, attention="linear", fmap="relu"),
    "linear-softmax-T9": dict(T=9, B=1, attention="linear", fmap="softmax"),
    "linear-cos1-GQA-T9": dict(T=9, B=2, attention="linear", fmap="cos1", cfg={"num_key_value_heads": 2}),
    "linear-hedgehog-GQA-T70": dict(T=PREFILL_ROWS + 6, B=2, attention="linear", fmap="hedgehog",
                                    cfg={"num_key_value_heads": 2, "feature_map": "hedgehog"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_prefill_equals_module_prefill(case):
    c = CASES[case]
    model = tiny_model(**c.get("cfg", {}))
    blocks, follow = [ids(1, c["B"], c["T"])], ids(2, c["B"], 12)
    kw = dict(attention=c.get("attention", "softmax"), fmap=c.get("fmap"))
    ref, ref_forms = prefill_then_steps(model, "module", blocks, follow, **kw)
    got, forms = prefill_then_steps(model, "native", blocks, follow, **kw)
    d = (ref - got).abs().max().item()
    print(f"{case}: max |logit diff| {d:.2e} (prefill and the 12 steps after it)")
    assert forms == ["native"] and ref_forms == ["module"]
    assert d <= 1e-4
    assert torch.equal(ref.argmax(-1), got.argmax(-1))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_prefill_after_prefill_and_greedy_tokens(attention):
    """A conversation's second block continues the first at its slots; greedy ids are identical."""
    model = tiny_model(num_key_value_heads=2)
    blocks, follow = [ids(3, 2, 7), ids(4, 2, PREFILL_ROWS + 3), ids(5, 2, 2)], ids(6, 2, 10)
    ref, _ = prefill_then_steps(model, "module", blocks, follow, attention=attention)
    got, forms = prefill_then_steps(model, "native", blocks, follow, attention=attention)
    d = (ref - got).abs().max().item()
    print(f"{attention}: max |logit diff| {d:.2e}")
    assert forms == ["native"] * 3 and d <= 1e-4
    assert torch.equal(ref.argmax(-1), got.argmax(-1))


def test_native_prefill_does_not_depend_on_threads():
    """Each row of a block is summed in one fixed order whoever computes it: 1, 2 and 5 threads give
    bit-identical logits."""
    model = tiny_model(hidden_size=128, intermediate_size=256)
    blocks, follow = [ids(7, 2, PREFILL_ROWS + 9)], ids(8, 2, 5)
    outs = [prefill_then_steps(model, "native", blocks, follow, threads=t)[0] for t in (1, 2, 5)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_16bit_prefill_equals_fp32_on_the_same_values(dtype):
    """16-bit weights are widened and computed in fp32: with an fp32 state, the native prefill of
    the 16-bit model equals the module prefill of the fp32 model holding the same values."""
    low = tiny_model(dtype=dtype, num_key_value_heads=2)
    high = tiny_model(dtype=dtype, num_key_value_heads=2).float()
    block = ids(9, 2, PREFILL_ROWS + 5)
    s_low, s_high = low.init_state(2, 80, dtype=torch.float32), high.init_state(2, 80)
    step = Stepper(low, "native", threads=2)
    got = step(block, s_low, last_only=True)
    ref = high.step(block, s_high, last_only=True)
    d = (ref - got).abs().max().item()
    print(f"{dtype}: max |logit diff| {d:.2e}")
    assert step.last_prefill_form == "native" and d <= 1e-4


def test_padded_blocks_run_row_by_row_and_full_logits_on_the_module_path():
    """A left-padded block, and a block on a state that holds pads, run row by row, each row on the
    pool as it runs alone (engine.steps.rows_alone; tests/test_batch_shapes.py holds them to it);
    a block whose every position's logits are asked for runs the module path."""
    model = tiny_model()
    step = Stepper(model, "native", threads=2)
    state = model.init_state(2, 32)
    valid = torch.tensor([[False, True, True], [True, True, True]])
    step(ids(10, 2, 3), state, valid=valid, last_only=True)
    assert step.last_prefill_form == "native" and state.padded and state.lengths.tolist() == [2, 3]
    step(ids(11, 2, 4), state, last_only=True)        # the state holds pads now: rows sit at their own positions
    assert step.last_prefill_form == "native" and state.lengths.tolist() == [6, 7]
    state = model.init_state(1, 32)
    out = step(ids(12, 1, 4), state)                  # every position's logits: the module path
    assert out.shape[1] == 4 and step.last_prefill_form == "module"


def test_native_prefill_past_the_cache_raises():
    from engine.errors import ContextFullError
    model = tiny_model()
    step = Stepper(model, "native", threads=2)
    state = model.init_state(1, 8)
    with pytest.raises(ContextFullError):
        step(ids(13, 1, 9), state, last_only=True)
    assert state.slots == 0


@pytest.mark.parametrize("dtype,form", [(torch.float32, "module"), (torch.bfloat16, "module"),
                                        (torch.float16, "native")], ids=["f32", "bf16", "f16"])
def test_auto_prefills_on_the_faster_form(dtype, form):
    """backend auto: prompt blocks of f16 weights on the native pool (PyTorch's f16 GEMM on a CPU is
    slow), fp32 and bf16 on PyTorch's GEMMs; decode steps native either way."""
    model = tiny_model(dtype=dtype)
    _prefill_then_step(model, form)


def test_auto_prefills_quantized_weights_on_the_native_pool():
    """PyTorch forms dequantize every matrix on every call; the native pool reads the blocks."""
    model = tiny_model()
    quantize_model(model, "q8_0")
    _prefill_then_step(model, "native")


def _prefill_then_step(model, form):
    step = Stepper(model, "auto", threads=2)
    state = model.init_state(1, 32)
    step(ids(14, 1, 6), state, last_only=True)
    assert step.last_prefill_form == form
    step(ids(15, 1, 1), state)
    assert step.last_form == "native"
