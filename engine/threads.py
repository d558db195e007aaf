"""CPU threads: one setting for PyTorch's intra-op pool and the native step.

    set_threads(None)   # the default, `default_threads()`
    set_threads(2)

The default is one thread. Measured on the 2-core dev VM (see the README, "Threads"), a decode
step of a small model is a chain of short kernels with a barrier after each; when another process
holds one of the two cores, a second thread waits at every barrier for a core it cannot get, and
decode went from 1.6 ms/token (1 thread) to 293 ms/token (2 threads). One thread loses little when
the machine is quiet and nothing when it is busy. `--threads N` / `threads=N` ask for more.
"""
from __future__ import annotations

import os

import torch

from engine.errors import InvalidArgumentError

_CURRENT: int | None = None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    return 1


def set_threads(threads: int | None) -> int:
    """Set PyTorch's intra-op threads (and remember the count for the native step); returns it."""
    global _CURRENT
    if threads is None:
        threads = default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise InvalidArgumentError(f"threads must be an integer >= 1, got {threads!r}")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _CURRENT = threads
    return threads


def current_threads() -> int:
    return _CURRENT if _CURRENT is not None else torch.get_num_threads()
