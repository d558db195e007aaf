"""Rows that finish while a going row holds a long KV cache stay in the batch state, decoded and
ignored, instead of being dropped by a copy of every going row (a 4k-token SmolLM2 row is ~190 MB: a
stall of every stream each time one ends; issue 29). They leave once they are as many as the going
rows, or with the next join; nobody's tokens change. (A KV batch on the CPU is a slab, whose rows leave in
place: tests/test_serve_slab.py.)"""
from __future__ import annotations

import pytest

import engine.serve.scheduler as scheduler
from engine.api import LLM
from engine.attention.softmax import KVState
from engine.sampling import SamplingParams
from tests.conftest import tiny_model
from tests.test_state_mixed import TRAINED, drive, mixed_model


def model_for(kind: str):
    if kind == "softmax":
        return tiny_model(seed=1, num_key_value_heads=2, trained_for=TRAINED)
    return mixed_model(kind)


@pytest.mark.parametrize("kind", ["softmax", "hybrid-hedgehog", "hybrid-window-hedgehog"])
def test_finished_rows_ride_along_while_a_long_row_lives_and_change_nobody(kind, monkeypatch):
    llm = LLM(model_for(kind), None, backend="auto")
    # a KV batch laid out as a slab drops rows in place (tests/test_serve_slab.py); as one that is not
    # (any device but the CPU) it lets them ride along
    monkeypatch.setattr(KVState, "slabs", False)
    long = ("long", [1, 5, 9, 20, 3, 7, 11, 2, 8, 6, 4, 4], SamplingParams(temperature=0.9, seed=7), 30)
    shorts = [(f"s{i}", [1, 7 + i], SamplingParams(temperature=0.8, seed=i), 4 + 3 * i) for i in range(4)]
    alone = {job[0]: drive(llm, {0: [job]})[job[0]] for job in [long, *shorts]}

    copies, layouts = [], []
    state_type = None
    real_drop = scheduler.Scheduler._drop

    def watched(self, pool, gone):
        real_drop(self, pool, gone)
        if pool.state is not None:
            layouts.append((len(pool.layout), len(pool.rows)))

    monkeypatch.setattr(scheduler.Scheduler, "_drop", watched)
    monkeypatch.setattr(scheduler, "DEFER_DROP_FROM", 10)      # the long row's 12 prompt tokens are "long"
    first = drive(llm, {0: [long], 2: shorts[:2]})
    state_type = type(llm.model.init_state(1, 4))
    original = state_type.select_rows

    def counting(self, idx, max_len=None):
        copies.append(list(idx))
        return original(self, idx, max_len)

    monkeypatch.setattr(state_type, "select_rows", counting)
    together = drive(llm, {0: [long], 2: shorts})
    for key, ids in alone.items():
        assert together[key] == ids, key
        assert first.get(key, ids) == ids, key
    assert any(n > going for n, going in layouts), "no finished row stayed in the batch"
    assert all(n - going <= going for n, going in layouts), "finished rows outnumbered the going ones"
    drops = [idx for idx in copies if len(idx) > 1]   # regroupings of the batch (not one prompt's row)
    assert len(drops) < len(shorts), f"a copy at every finished row: {drops}"


@pytest.mark.parametrize("kind", ["softmax", "window"])
def test_short_rows_still_leave_at_once(kind, monkeypatch):
    """With no long KV row (or no KV cache at all: a window state's rows are constant-size) a finished
    row leaves the state at its last token (the copy is cheap)."""
    llm = LLM(model_for(kind), None, backend="auto")
    if kind == "window":   # every row "long": only the state's kind keeps the rows from riding along
        monkeypatch.setattr(scheduler, "DEFER_DROP_FROM", 2)
    layouts = []
    real_drop = scheduler.Scheduler._drop

    def watched(self, pool, gone):
        real_drop(self, pool, gone)
        layouts.append((len(pool.layout), len(pool.rows)))

    monkeypatch.setattr(scheduler.Scheduler, "_drop", watched)
    jobs = [(f"s{i}", [1, 7 + i], SamplingParams(temperature=0), 3 + 2 * i) for i in range(3)]

    drive(llm, {0: jobs})
    assert layouts and all(n == going for n, going in layouts)
