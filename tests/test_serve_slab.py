"""A KV batch on the CPU is a slab (KVState.concat(rows=, headroom=)): spare rows, and its rows
right-aligned at a slot past any prompt the server takes, so a row joins by writing itself into a
spare row and leaves by one tail row moving into its place, and no other row's keys move (issue 29:
a 4k-token prompt joining 16 streams copied all their caches, ~1 GB, a ~350 ms stall of every
stream). Each row still computes what it computes alone, bit for bit on the native step."""
from __future__ import annotations

import pytest
import torch

import engine.serve.scheduler as scheduler
from engine.api import LLM
from engine.attention.softmax import KVState
from engine.sampling import SamplingParams
from engine.serve import PrefixCache
from engine.steps import Stepper
from tests.conftest import poison_unwritten, tiny_model
from tests.test_batch_shapes import smollm2_shaped
from tests.test_state_mixed import TRAINED, drive

pytestmark = pytest.mark.usefixtures("native_built")   # tests/conftest.py: built, or skipped with the reason

PROMPTS = [[1, 5, 9, 20, 3], [1, 7], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1], [2, 8, 6]]
STEPS = 10


def prefill(step, model, ids):
    s = model.init_state(1, len(ids) + STEPS, "softmax")
    return s, step(torch.tensor([ids]), s, last_only=True)[:, -1]


def solo(step, model, ids):
    s, logits = prefill(step, model, ids)
    out = [int(logits.argmax())]
    for _ in range(STEPS - 1):
        out.append(int(step(torch.tensor([[out[-1]]]), s)[0, -1].argmax()))
    return out


def real_keys(state, row):
    """Row `row`'s real keys and values, in slot order."""
    real = state.slot_real[row, :state.slots]
    return state.k[:, row, :, :state.slots][:, :, real].clone(), state.v[:, row, :, :state.slots][:, :, real].clone()


@pytest.mark.parametrize("form", ["native", "torch"])
def test_rows_join_and_leave_a_slab_in_place_and_decode_as_alone(form):
    """On SmolLM2's shapes (q8_0): rows 0 and 1 start a slab; row 2 (longer than the batch's own
    slots, within the headroom) and row 3 join in place (the slab's memory and the running rows'
    keys untouched); row 1 leaves (the tail row moves into its place); the unwritten slots hold NaN
    throughout. Every row's greedy tokens equal its solo run."""
    model = smollm2_shaped("q8_0", "softmax")
    step = Stepper(model, form, threads=2)
    with torch.no_grad():
        want = [solo(step, model, ids) for ids in PROMPTS]
        outs, rows = [[] for _ in PROMPTS], []
        state = None
        for t in range(STEPS + 4):
            joining = {0: [0, 1], 2: [2], 3: [3]}.get(t, [])
            if joining:
                parts = [prefill(step, model, PROMPTS[i]) for i in joining]
                for i, (_, logits) in zip(joining, parts):
                    outs[i].append(int(logits.argmax()))
                states = [s for s, _ in parts]
                if state is None:
                    state = KVState.concat(states, max_len=8 + STEPS, rows=6, headroom=24)
                    assert state.k.shape[1] == 2 and state.slab[0].shape[1] == 6 and state.slots == 24
                else:
                    before = state.k.data_ptr(), [real_keys(state, b) for b in range(len(rows))]
                    state = state.join(states, max_len=max(s.slots for s in states) + STEPS)
                    assert state is not None, "the rows did not fit the slab"
                    assert state.k.data_ptr() == before[0], "the slab was laid out again"
                    for b, (k, v) in enumerate(before[1]):
                        got = real_keys(state, b)
                        assert torch.equal(got[0], k) and torch.equal(got[1], v), f"row {b} moved"
                rows += joining
                poison_unwritten(state)
            if rows:
                logits = step(torch.tensor([[outs[i][-1]] for i in rows]), state)[:, -1]
                assert torch.isfinite(logits).all()
                for b, i in enumerate(rows):
                    outs[i].append(int(logits[b].argmax()))
            if t == 4:   # row 1 leaves early: row 3 (the tail) takes its place
                keep = [b for b, i in enumerate(rows) if i != 1]
                ptr = state.k.data_ptr()
                state, order = state.keep_rows(keep)
                assert state.k.data_ptr() == ptr and order == [0, 3, 2]
                rows = [rows[b] for b in order]
                poison_unwritten(state)
            done = [b for b, i in enumerate(rows) if len(outs[i]) >= STEPS]
            if done:
                keep = [b for b in range(len(rows)) if b not in done]
                if not keep:
                    break
                state, order = state.keep_rows(keep)
                rows = [rows[b] for b in order]
    assert [o[:STEPS] for i, o in enumerate(outs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    assert outs[1] == want[1][:len(outs[1])]


def test_a_row_that_does_not_fit_is_refused_by_join():
    """join answers None (the caller lays out a new slab) for a row longer than the batch's slots,
    with no spare row, or without the slots its tokens need."""
    model = tiny_model(seed=1, num_key_value_heads=2)
    step = Stepper(model, "torch")
    with torch.no_grad():
        a, b, c = (prefill(step, model, ids)[0] for ids in PROMPTS[:3])
        slab = KVState.concat([a], max_len=5 + STEPS, rows=2, headroom=8)
        assert slab.join([c], max_len=18 + STEPS) is None        # 18 tokens > 8 slots
        assert slab.join([b], max_len=2 + 1000) is None          # no room for 1,000 tokens
        two = slab.join([b], max_len=2 + STEPS)
        assert two is not None and two.batch_size == 2
        assert two.join([b], max_len=2 + STEPS) is None          # no spare row left
        assert KVState.concat([a], max_len=5 + STEPS).join([b], 2 + STEPS) is None   # not a slab


def test_the_scheduler_joins_a_long_prompt_without_moving_the_running_rows(monkeypatch):
    """The server's loop: three rows run, a prompt longer than any of them joins, rows finish; the
    only rows ever copied into a batch are the new ones (one each), and every job's tokens equal its
    run alone. A prompt longer than the headroom lays the slab out anew (every row copied), tokens
    still unchanged."""
    llm = LLM(tiny_model(seed=1, num_key_value_heads=2, trained_for=TRAINED), None, backend="auto")
    jobs = {0: [("a", [1, 5, 9], SamplingParams(temperature=0.9, seed=7), 30)],
            2: [("b", [1, 7], SamplingParams(temperature=0), 6), ("c", [2, 3, 4], SamplingParams(temperature=0), 12)],
            6: [("long", list(range(3, 40)), SamplingParams(temperature=0.8, seed=2), 10)]}
    alone = {job[0]: drive(llm, {0: [job]})[job[0]] for at in jobs.values() for job in at}
    copied = []
    put = KVState._put_row

    def counting(self, row, at, end, src, src_row, src_from):
        copied.append(end - at)
        return put(self, row, at, end, src, src_row, src_from)

    monkeypatch.setattr(KVState, "_put_row", counting)
    together = drive(llm, jobs, kv_headroom=64)
    for key, ids in alone.items():
        assert together[key] == ids, key
    # one copy per joining row, each of its own prompt's slots: no running row was copied
    assert sorted(copied) == sorted([3, 2, 3, 37]), copied

    copied.clear()
    together = drive(llm, jobs, kv_headroom=16)   # the long prompt does not fit: laid out anew
    for key, ids in alone.items():
        assert together[key] == ids, key
    assert len(copied) > 4, copied


def staged_llm():
    return LLM(tiny_model(seed=1, num_key_value_heads=2, num_hidden_layers=4, trained_for=TRAINED), None,
               backend="auto")


STAGED_JOBS = {0: [("a", [1, 5, 9], SamplingParams(temperature=0.9, seed=7), 30)],
               2: [("b", [1, 7], SamplingParams(temperature=0), 6), ("c", [2, 3, 4], SamplingParams(temperature=0), 12)],
               6: [("long", list(range(3, 40)), SamplingParams(temperature=0.8, seed=2), 10)],
               7: [("d", [5, 6], SamplingParams(temperature=0.7, seed=4), 8)]}


def watch_staging(monkeypatch, on_stage=None, stage_bytes: int = 10 * 1024) -> list:
    """Rows a layer of KV is 1,024 bytes here (4 layers x 2 heads x 16 x fp32 x k, v): rows over 10 KB
    (the 37-token prompt) join a layer a step. Returns a list that gets, per iteration with a staged
    row, the layers it holds."""
    monkeypatch.setattr(scheduler, "STAGE_BYTES", stage_bytes)
    seen = []
    real = scheduler.Scheduler._stage

    def watched(self, path):
        st = self.pools[path].staging
        if st is not None:
            seen.append(st.layer)
            if on_stage is not None:
                on_stage(self, st)
        return real(self, path)

    monkeypatch.setattr(scheduler.Scheduler, "_stage", watched)
    return seen


def test_a_long_row_joins_a_layer_a_step_and_changes_nobody(monkeypatch):
    """The long prompt's row is copied into the slab over 4 steps (a layer each; the row that arrives
    meanwhile waits, then joins); nothing of the running rows is copied, and every job's tokens
    equal its run alone."""
    llm = staged_llm()
    alone = {job[0]: drive(llm, {0: [job]})[job[0]] for at in STAGED_JOBS.values() for job in at}
    seen = watch_staging(monkeypatch)
    copied = []
    put = KVState._put_row
    monkeypatch.setattr(KVState, "_put_row", lambda self, *a: (copied.append(a[2] - a[1]), put(self, *a))[1])
    together = drive(llm, STAGED_JOBS, kv_headroom=64)
    for key, ids in alone.items():
        assert together[key] == ids, key
    assert seen == [0, 1, 2, 3], seen
    assert sorted(copied) == sorted([3, 2, 3, 2]), copied   # a, b, c and d: no running row, not the long one


@pytest.mark.parametrize("event", ["cancelled", "batch ends"])
def test_a_staged_row_whose_batch_changes_still_joins(monkeypatch, event):
    """The staged job cancelled mid-copy: it sends nothing more, the waiting row joins, the others go
    on unchanged. Every running row gone mid-copy (cancelled): the staged row joins a new batch, its
    tokens unchanged."""
    llm = staged_llm()
    alone = {job[0]: drive(llm, {0: [job]})[job[0]] for at in STAGED_JOBS.values() for job in at}
    gone = set()

    def change(sched, st):
        if st.layer != 2:
            return
        pool = next(p for p in sched.pools.values() if p.staging is st)
        for run in [st.run] if event == "cancelled" else pool.rows:
            run.job.cancel()
            gone.add(run.job)
    seen = watch_staging(monkeypatch, change)
    together = drive(llm, STAGED_JOBS, kv_headroom=64)
    assert seen[:3] == [0, 1, 2], seen
    stopped = {key for key, ids in alone.items() if len(together[key]) < len(ids)}
    assert len(stopped) == len(gone) >= 1 and ("long" in stopped) == (event == "cancelled"), (stopped, gone)
    for key, ids in alone.items():
        assert together[key] == ids[:len(together[key])], key
        assert key in stopped or together[key] == ids, key


@pytest.mark.parametrize("first", ["joins", "cancelled"])
def test_a_long_row_that_waited_for_another_joins_after_one_pass(monkeypatch, first):
    """Two long prompts ready at once (prefilled together): the first is staged, the second waits,
    then is staged as the first joins (or is cancelled mid-copy). Each row's layers are copied once
    (4 layers, one a step) and the second joins while the batch still runs: not restaged step after
    step until the batch empties (its slot was fixed a step short of where the batch was when its
    last layer went in)."""
    llm = staged_llm()
    jobs = {0: [("a", [1, 5, 9], SamplingParams(temperature=0.9, seed=7), 40)],
            6: [("long", list(range(3, 17)), SamplingParams(temperature=0.8, seed=2), 10),
                ("long2", list(range(4, 18)), SamplingParams(temperature=0.8, seed=3), 10)]}
    alone = {job[0]: drive(llm, {0: [job]})[job[0]] for at in jobs.values() for job in at}

    def cancel_first(sched, st):
        if first == "cancelled" and st.layer == 2 and st.run.job.ids == jobs[6][0][1]:
            st.run.job.cancel()
    watch_staging(monkeypatch, cancel_first, stage_bytes=4 * 1024)   # a 14-token row: 14 KB, a layer a step
    staged = []
    real = KVState.stage
    monkeypatch.setattr(KVState, "stage", lambda self, state, slot, layers: (
        staged.append((id(state), layers.start)), real(self, state, slot, layers))[1])
    together = drive(llm, jobs, kv_headroom=64)
    for key, ids in alone.items():
        assert together[key] == ids[:len(together[key])], key
        assert together[key] == ids or (key == "long" and first == "cancelled"), key
    assert len(set(row for row, _ in staged)) == 2, staged
    first_pass = [0, 1, 2, 3] if first == "joins" else [0, 1]
    assert [layer for _, layer in staged] == first_pass + [0, 1, 2, 3], staged


def test_a_slab_under_steady_load_stays_as_long_as_its_rows():
    """Jobs arriving one after another, the batch never empty: a slab's rows cannot shift left in
    place, so its slots grow a step at a time; a new slab laid out (no room left) must drop the
    leading slots that are pads in every row, as select_rows does, or a server under steady load
    lays out ever longer slabs (address space, and per-step scans of slot_real, growing with uptime)
    until an allocation fails and every stream fails. Each job's tokens still equal its run alone."""
    llm = LLM(tiny_model(seed=1, num_key_value_heads=2, trained_for=TRAINED), None, backend="auto")
    prompts = [[1, 2, 3, 4], [5, 6, 7], [1, 9, 9, 9, 2]]
    greedy = SamplingParams(temperature=0)
    alone = [drive(llm, {0: [("x", ids, greedy, 12)]})["x"] for ids in prompts]
    sched = scheduler.Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=4, kv_headroom=8,
                                cache=PrefixCache(max_entries=0))
    outs, longest = {}, 0
    for it in range(160):
        new = [] if it % 5 or it >= 140 else [scheduler.Job(
            ids=prompts[it % 3], path=llm.attention, params=greedy, max_tokens=12, ignore_eos=True,
            emit=lambda ev, k=it: outs.setdefault(k, []).append(ev.id))]
        sched._iterate(new)
        pool = sched.pools.get(llm.attention)
        if pool is not None and pool.state is not None:
            assert pool.state.slab is not None
            longest = max(longest, pool.state.slots)
    assert len(outs) == 28 and all(ids == alone[k % 3] for k, ids in outs.items())
    # rows hold at most 5 + 12 tokens; the slab sits at slot >= 8 with room for 12 more
    assert longest <= 8 + 2 * (5 + 12), longest


def test_the_torch_step_copies_no_pad_of_a_slab(monkeypatch):
    """Rows with the same first real slot that are not neighbours (in a slab: n > 1 choices joined
    together, then a tail row moved between them) attend over a copy of their keys: it holds their
    real slots, not the slab's leading pads (it copied all 4k of them, a row a layer a step: on
    SmolLM2's shapes 3 rows decoded 5x slower). The rows still decode as alone."""
    model = tiny_model(seed=1, num_key_value_heads=2)
    step = Stepper(model, "torch")
    prompts = [[2, 8, 6], [1, 7], [5, 9, 3]]
    copies = []
    one_query = KVState._one_query
    monkeypatch.setattr(KVState, "_one_query", lambda self, q, keys, values: (
        copies.append(keys.untyped_storage().nbytes()) if keys.untyped_storage().data_ptr() !=
        self.k.untyped_storage().data_ptr() else None, one_query(self, q, keys, values))[1])
    with torch.no_grad():
        want = [solo(step, model, ids) for ids in prompts]
        parts = [prefill(step, model, ids) for ids in prompts]
        state = KVState.concat([s for s, _ in parts], max_len=3 + STEPS, rows=4, headroom=4096)
        outs = [[int(logits.argmax())] for _, logits in parts]
        for _ in range(STEPS - 1):
            logits = step(torch.tensor([[o[-1]] for o in outs]), state)[:, -1]
            for o, row in zip(outs, logits):
                o.append(int(row.argmax()))
    assert outs == want
    L, _, Hkv, _, D = state.k.shape
    assert copies and max(copies) <= 2 * Hkv * (3 + STEPS) * D * 4, max(copies)   # rows 0 and 2, their slots


def test_a_slab_counts_the_bytes_its_rows_hold_not_its_room():
    """nbytes of a slab: its rows' real keys and values (what /health's batch bytes report), not the
    spare rows and headroom it reserves as address space."""
    model = tiny_model(seed=1, num_key_value_heads=2)
    step = Stepper(model, "torch")
    with torch.no_grad():
        a, b = (prefill(step, model, ids)[0] for ids in PROMPTS[:2])
        slab = KVState.concat([a, b], max_len=5 + STEPS, rows=8, headroom=100)
        plain = KVState.concat([a, b], max_len=5 + STEPS)
    L, _, Hkv, _, D = slab.k.shape
    assert slab.nbytes == 2 * L * Hkv * D * 4 * (5 + 2)
    assert plain.nbytes == plain.k.numel() * 8 > slab.nbytes


def test_a_slab_reserves_at_most_half_the_memory():
    """SmolLM2 (46 KB of fp32 KV a token, 16 rows): 8k of headroom fits 24 GB; a 128k context of a
    1B model (64 KB a token) is cut to what half the memory holds."""
    gib = 1 << 30
    assert scheduler.slab_headroom(8192, 16, 46080, ram=24 * gib) == 8192
    cut = scheduler.slab_headroom(131072, 16, 65536, ram=24 * gib)
    assert cut < 131072 and 16 * 2 * cut * 65536 <= 12 * gib < 16 * 2 * (cut + 1) * 65536
