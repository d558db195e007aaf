"""CPU threads: one setting for PyTorch's intra-op pool and the native step's pool.

    set_threads(None)   # the default: the native step on default_threads(), PyTorch on 1
    set_threads(2)      # both on 2

Two pools, two behaviours when another process holds a core (README, "Threads"):
- PyTorch's OpenMP pool waits at a barrier after every short kernel; a thread descheduled mid-
  kernel stalls every barrier for a scheduler slice, and spinning waiters eat the core it needs:
  decode went from 1.6 ms/token (1 thread) to 293 ms/token (2 threads) with one core busy.
  By default PyTorch (prompt blocks, the torch step form) runs on one thread, which cannot stall.
- The native step's pool (engine/steps/native/pool.c) has no barriers: chunks are claimed
  dynamically, the calling thread works too, and a chunk whose worker lost its core is stolen
  after a bounded wait. So it keeps its speed with a core taken and uses every core by default.
`--threads N` / `threads=N` set both pools to N.
"""
from __future__ import annotations

import os

import torch

from engine.errors import InvalidArgumentError



def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """The native step's default: every core this process may run on."""
    return available_cores()


class ThreadsError(InvalidArgumentError):
    """A thread count that is not an integer >= 1."""


def check_threads(threads) -> int | None:
    """None (the defaults) or an integer >= 1: the rule, once (RunSpec.resolve, set_threads)."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ThreadsError(f"threads must be an integer >= 1, got {threads!r}")
    return threads


def set_threads(threads: int | None) -> int:
    """Set PyTorch's intra-op threads (its own process-wide setting) for `threads`; returns the count
    the native step runs on for the same setting. The native count is not kept here: it travels in
    the run's spec (RunSpec.threads) to the step that uses it.

    None: the defaults (native: default_threads(); PyTorch: 1, steady under load)."""
    check_threads(threads)
    torch_threads = 1 if threads is None else threads
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    return default_threads() if threads is None else threads


def current_threads() -> int:
    """The native step's thread count where a run gives none: default_threads() (kept for callers
    of the old module-global setting, which is gone: a run's count is RunSpec.threads)."""
    return default_threads()
