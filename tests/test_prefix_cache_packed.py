"""The prefix cache keeps window states packed (engine.attention.packed): the slots a prompt holds, S, z
and the sparse cache only once they hold something, and gives back a state that continues as the
prompt's own did."""
from __future__ import annotations

import pytest
import torch

from conftest import greedy, tiny_model
from engine.attention import HybridState
from engine.attention.sparse import BLOCK, SparseWindowState
from engine.serve import PrefixCache
from engine.steps import Stepper

MIXES = {
    "window": dict(attention="linear", window=24),
    "sparse": dict(attention="linear", window=6, sparse_keys=3),
    "hybrid-sparse": dict(attention="hybrid", layer_attention=("linear", "softmax", "linear"), num_hidden_layers=3,
                          window=6, sparse_keys=3),
}


def prefilled(mix: str, n: int):
    model = tiny_model(seed=3, num_key_value_heads=2, **MIXES[mix])
    step = Stepper(model, "torch")
    state = model.init_state(1, n)
    ids = torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n))
    logits = step(ids, state, last_only=True)[:, -1]
    return step, state, ids[0].tolist(), logits


def window_part(state):
    return state.parts[-1] if isinstance(state, HybridState) else state


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("n", [3, BLOCK + 20], ids=["short", "past-a-decision"])
def test_a_cached_window_state_holds_its_slots_and_continues_as_the_prompts_own(mix, n):
    step, state, ids, logits = prefilled(mix, n)
    want = greedy(step, state.select_rows([0], max_len=n + 12), logits, 12)
    full = state.nbytes
    cache = PrefixCache()
    cache.put("p", ids, state, logits, owned=True)
    entry = cache.entries[("p", tuple(ids))]
    lin = window_part(state)
    if n == 3:   # 3 of the window's slots, nothing in S, z or the sparse cache: a small share of the state
        assert entry.nbytes - logits.numel() * 4 < full / 5
        if isinstance(lin, SparseWindowState):
            assert not lin.cuse.any()
    else:        # keys left the window: S (and the sparse cache) hold them, and are kept
        assert lin.S.any() and (not isinstance(lin, SparseWindowState) or lin.cuse.any())
    got = entry.state
    assert got is not entry.state and type(got) is type(state)   # a fresh state each time
    assert torch.equal(got.lengths, state.lengths) and got.slots == state.slots
    assert greedy(step, got.select_rows([0], max_len=n + 12), logits, 12) == want


def test_a_short_prompts_packed_state_unpacks_to_the_same_tensors():
    """An unpadded prompt shorter than the window: every slot it did not fill is zero in the state too."""
    _, state, ids, logits = prefilled("window", 5)
    got = state.packed().unpacked()
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), state.tensors()))
    assert torch.equal(got.wreal, state.wreal)


def test_the_caches_budget_holds_more_short_window_prompts():
    """The byte budget counts packed states: 8 short prompts fit where their full states would not."""
    step, state, ids, logits = prefilled("hybrid-sparse", 4)
    cache = PrefixCache(max_bytes=3 * state.nbytes)
    for i in range(8):
        cache.put("p", [i] + ids, state.select_rows([0]), logits)
    assert len(cache.entries) == 8 and cache.stats()["bytes"] == cache.bytes <= 3 * state.nbytes
