"""A batch laid out from other states on the CPU (`KVState.concat` / `select_rows`: the server joining and
dropping rows) writes each row's real slots and nothing else (engine/attention/softmax.py's docstring):
a long prompt joining short rows must not write their pad slots (issue 29: a 4k-token prompt joining 16
SmolLM2 rows wrote ~3.4 GB of zeros, a ~1 s stall of every stream), and no reader may then see what the
unwritten slots hold."""
from __future__ import annotations

import sys

import pytest
import torch

from engine.attention import KVState
from tests.conftest import poison_unwritten, tiny_model


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def kv(batch: int, slots: int, capacity: int) -> KVState:
    s = KVState.allocate_shape(4, batch, 2, capacity, 64, "cpu", torch.float32)
    s.k[:, :, :, :slots].normal_()
    s.v[:, :, :, :slots].normal_()
    s.slots = slots
    s.lengths.fill_(slots)
    return s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_long_row_joining_short_ones_writes_none_of_their_pad_slots():
    """16 rows of 40 slots join one of 8,192: right-aligned, they get 8,152 leading pad slots each
    (16 x 8,152 slots x 4 KiB = 510 MiB if written). The joined cache's resident growth stays near
    what is copied (the long row's 32 MiB + the short rows')."""
    short, long = kv(16, 40, 100), kv(1, 8192, 8192)
    before = resident_mb()
    joined = KVState.concat([short, long], max_len=8192 + 60)
    grown = resident_mb() - before
    assert joined.slots == 8192 and joined.padded
    assert torch.equal(joined.k[:, :16, :, 8192 - 40:8192], short.k[:, :, :, :40])
    assert torch.equal(joined.v[:, 16, :, :8192], long.v[:, 0, :, :8192])
    assert grown < 128, f"the join made {grown:.0f} MiB resident: pad slots were written"


def test_a_masked_block_on_a_joined_batch_reads_no_unwritten_slot():
    """A block of two tokens per row on a joined (padded) batch runs the masked attention, which reads
    every slot it holds: with NaN in the pads and past the last slot, its logits are finite and equal
    those of the same batch with those slots zeroed."""
    model = tiny_model(seed=3)
    prompts = [[1, 5, 9, 20, 3], [1, 7], [4, 4, 4, 4, 4, 4, 4, 1]]

    def joined():
        rows = []
        for ids in prompts:
            s = model.init_state(1, 16, attention="softmax")
            model.step(torch.tensor([ids]), s)
            rows.append(s)
        return KVState.concat(rows, max_len=16)

    clean, poisoned = joined(), joined()
    clean.zero_unwritten()
    poison_unwritten(poisoned)
    block = torch.tensor([[11, 12], [13, 14], [15, 16]])
    want, got = model.step(block, clean), model.step(block, poisoned)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_fresh_cache_on_the_cpu_holds_only_what_was_written():
    """init_state does not zero a CPU cache: 16,384 slots of an 8-layer model (256 MiB of k and v) cost
    nothing resident until tokens are written, and a prompt fed then decodes as on a zeroed cache."""
    model = tiny_model(seed=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8,
                       max_position_embeddings=16384)
    before = resident_mb()
    state = model.init_state(1, 16384, attention="softmax")
    grown = resident_mb() - before
    assert state.nbytes == 256 * 2**20
    assert grown < 32, f"allocating the cache made {grown:.0f} MiB resident"
    zeroed = model.init_state(1, 16384, attention="softmax")
    zeroed.k.zero_()
    zeroed.v.zero_()
    prompt = torch.tensor([[1, 5, 9, 20, 3, 7]])
    for s in (state, zeroed):
        model.step(prompt, s, last_only=True)
    poison_unwritten(state)
    for t in (11, 12, 13):
        got, want = model.step(torch.tensor([[t]]), state), model.step(torch.tensor([[t]]), zeroed)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_static_step_zeroes_the_slots_it_reads_under_a_mask():
    """The static step form reads a whole bucket of slots past `slots` under a mask: on a fresh CPU cache
    (unwritten past the prompt, here NaN) it zeroes them first and equals the torch step."""
    from engine.steps import TorchStep
    from engine.steps.graph_step import step_static

    model = tiny_model(seed=5, num_key_value_heads=2)
    tokens = torch.tensor([[1, 5, 9, 20, 3, 7, 11, 2, 8]])
    a, b = (model.init_state(1, 64, attention="softmax") for _ in range(2))
    for s in (a, b):
        model.step(tokens[:, :5], s, last_only=True)
        poison_unwritten(s)
    torch_form = TorchStep(model)
    plan = torch_form.plan_for(tokens)
    for t in range(5, 9):
        with torch.inference_mode():
            got = step_static(plan, tokens[:, t:t + 1], a, min_bucket=4)
        want = torch_form(tokens[:, t:t + 1], b)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
