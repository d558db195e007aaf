"""The native pool's adaptive mode (pool.c): phases that switch between the caller alone and the
workers within a step (solo stretches, probes, workers told to sleep and woken again) compute the
same bits as one thread. Results only; timing is for benchmarks/native_threads.py."""
import pytest
import torch

from engine.steps.native import pool_adapt, pool_stats
from tests.conftest import tiny_model
from tests.test_native import run, tokens

pytestmark = pytest.mark.usefixtures("native_built")   # tests/conftest.py: built, or skipped with the reason


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("threads", [2, 5])
def test_solo_stretches_and_probes_give_the_same_bits(threads, attention):
    model = tiny_model(hidden_size=128, intermediate_size=256)
    prompt, follow = tokens(4, batch=3, follow=40)
    want = run(model, prompt, follow, "native", batch=3, threads=1, attention=attention)[0]
    try:
        # a verdict after every phase, and every one fails: solo for 20 us (doubling to 320 us), probe, ...
        pool_adapt(window=1, min_speedup_pct=10**6, solo_ns=20_000)
        pool_stats(reset=True)
        got = run(model, prompt, follow, "native", batch=3, threads=threads, attention=attention)[0]
        st = pool_stats(reset=True)
    finally:
        pool_adapt()
    print(st)
    assert st["solo_phases"] > 0 and st["parallel_phases"] > 0, "the step did not switch between solo and pool"
    assert st["solo_verdicts"] == st["verdicts"] > 0
    assert torch.equal(got, want)


def test_adaptive_mode_scores_and_never_forgets_work():
    """Adaptive mode on (a verdict every 32 phases; off by default): counters move and results still
    equal one thread's."""
    model = tiny_model(hidden_size=128, intermediate_size=256)
    prompt, follow = tokens(5, batch=2, follow=50)
    want = run(model, prompt, follow, "native", batch=2, threads=1)[0]
    try:
        pool_adapt(window=32)
        pool_stats(reset=True)
        got = run(model, prompt, follow, "native", batch=2, threads=2)[0]
        st = pool_stats(reset=True)
    finally:
        pool_adapt()
    assert st["verdicts"] > 0 and st["parallel_phases"] > 0
    assert torch.equal(got, want)


def test_the_default_never_runs_solo():
    """The default pool (adaptive mode off) keeps every phase on the workers: no verdicts, no solo
    phases, results equal one thread's."""
    model = tiny_model(hidden_size=128, intermediate_size=256)
    prompt, follow = tokens(6, batch=2, follow=50)
    want = run(model, prompt, follow, "native", batch=2, threads=1)[0]
    pool_adapt()
    pool_stats(reset=True)
    got = run(model, prompt, follow, "native", batch=2, threads=2)[0]
    st = pool_stats(reset=True)
    assert st["parallel_phases"] > 0 and st["verdicts"] == 0 and st["solo_phases"] == 0
    assert torch.equal(got, want)


@pytest.mark.parametrize("env, want", [({}, "10000"), ({"GOMP_SPINCOUNT": "5"}, "5"),
                                       ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_importing_the_engine_shortens_openmp_spinning_unless_the_user_chose(env, want):
    """PyTorch's OpenMP threads spin long after each kernel and take the cores the native pool needs
    next (engine/__init__.py): importing the engine before torch sets GOMP_SPINCOUNT, but never over a
    setting of the user's own (GOMP_SPINCOUNT or OMP_WAIT_POLICY)."""
    import os
    import subprocess
    import sys
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", "import engine, os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env={**clean, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(want)


def test_rest_puts_the_idle_workers_to_sleep_at_once():
    """pool_rest (what the server calls after each step, before delivering its tokens): idle workers
    sleep now instead of spinning for the next phase, and the next step wakes them and computes the
    same bits. (With the spin stretched to a minute, only rest can put them to sleep.)"""
    import time

    from engine.steps.native import pool_rest, pool_spin, pool_workers
    model = tiny_model(hidden_size=128, intermediate_size=256)
    prompt, follow = tokens(7, batch=2, follow=8)
    want = run(model, prompt, follow, "native", batch=2, threads=1)[0]
    try:
        pool_spin(60 * 10**9)
        got = run(model, prompt, follow, "native", batch=2, threads=2)[0]   # the pool's worker is running now
        time.sleep(0.2)
        workers, asleep_before = pool_workers()
        pool_rest()
        deadline = time.monotonic() + 10
        while pool_workers()[1] < workers and time.monotonic() < deadline:
            time.sleep(0.001)
        asleep = pool_workers()[1]
        again = run(model, prompt, follow, "native", batch=2, threads=2)[0]
    finally:
        pool_spin()
    assert workers >= 1 and asleep_before == 0 and asleep == workers
    assert torch.equal(got, want) and torch.equal(again, want)
