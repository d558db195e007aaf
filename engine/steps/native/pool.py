"""The native step's thread pool (pool.c), process-wide as the pool itself: its knobs and counters.

    pool_rest()            # idle workers sleep now (a server about to deliver a step's tokens)
    pool_stats(reset=True) # counters since the last reset (benchmarks/pool_phases.py)

How many threads a step uses is the step's own (NativeStep(threads=...), RunSpec.threads).
"""
from __future__ import annotations

import ctypes

from engine.steps.native.abi import bind

PARALLEL_MIN_MACS = 65536   # decode.c's gen_par_min_macs, the default
POOL_ADAPT = (0, 115, 2_000_000)   # pool.c's defaults: phases per verdict (0: adaptive mode off), min speedup (%), solo ns


def set_parallel_min(macs: int) -> None:
    """Phases below `macs` multiply-adds run on the calling thread alone (tests: 0 puts every phase
    on the pool, so small models exercise it; PARALLEL_MIN_MACS is the default)."""
    bind().gen_set_parallel_min(macs)


def pool_adapt(window: int = POOL_ADAPT[0], min_speedup_pct: int = POOL_ADAPT[1], solo_ns: int = POOL_ADAPT[2]) -> None:
    """How the pool decides that its workers do not pay (a core taken by another process) and runs
    phases on the caller alone for a while (pool.c): a verdict every `window` phases (0: never solo),
    solo when the phases ran less than `min_speedup_pct`/100 times faster than the caller alone would,
    for `solo_ns` (doubling on each failed probe, up to 16x). No arguments: the defaults."""
    bind().gen_pool_adapt(window, min_speedup_pct, solo_ns)


def pool_rest() -> None:
    """Let the pool's idle workers sleep now rather than spin (~2 ms) waiting for the next phase:
    for a caller about to spend a while outside the step, e.g. a server delivering a step's tokens
    while other threads (its event loop, clients) need the cores. The next phase wakes them."""
    bind().gen_pool_rest()


def pool_spin(ns: int = -1) -> None:
    """How long an idle worker spins before it sleeps, in ns (tests; -1: the default, 2 ms)."""
    bind().gen_pool_spin(ns)


def pool_workers() -> tuple[int, int]:
    """(the pool's worker threads, how many of them sleep right now)."""
    out = (ctypes.c_int * 2)()
    bind().gen_pool_workers(out)
    return out[0], out[1]


def pool_stats(reset: bool = False) -> dict:
    """The pool's counters since the last reset: phases run parallel and solo, verdicts, failed
    verdicts, and the scored phases' estimated time alone and wall time (ns); the parallel phases'
    chunks, those the caller ran (its own and stolen), those it stole from a late worker, its time
    waiting for the workers after its last own chunk, and the phases' wall time (ns)."""
    out = (ctypes.c_longlong * 11)()
    bind().gen_pool_stats(out, int(reset))
    keys = ("parallel_phases", "solo_phases", "verdicts", "solo_verdicts", "alone_ns", "wall_ns",
            "chunks", "caller_chunks", "stolen_chunks", "caller_wait_ns", "phase_ns")
    return dict(zip(keys, out))
