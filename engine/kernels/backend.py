"""Whether the Triton kernels can run, and the kernels themselves, built on first use.

Triton is imported lazily (it is optional, and importing it costs ~0.5 s): `why_not()` answers
without importing it where the tensors alone decide. The kernels run on CUDA tensors, or on CPU
tensors under `TRITON_INTERPRET=1` (Triton's interpreter, which CI uses to check them without a GPU).
The flag is read on each call, and the interpreted and compiled kernels are built and cached
separately, so setting it for one test does not change what another runs.
"""
from __future__ import annotations

import functools
import os

import torch

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)   # the tensors the kernels read


def interpreting() -> bool:
    """TRITON_INTERPRET set (Triton's own reading of it: 1, true, yes or on)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_error() -> str | None:
    """None when triton imports; else why not, in one line."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e}); pip install triton"
    except Exception as e:   # a broken install: say so, and run the torch path
        return f"triton failed to import: {type(e).__name__}: {e}"
    return None


def why_not(*tensors: torch.Tensor) -> str | None:
    """None when the Triton kernels run on these tensors; else the one-line reason the torch path runs."""
    device = tensors[0].device
    if device.type != "cuda" and not interpreting():
        return f"tensors on {device.type}: the Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1)"
    for t in tensors:
        if t.dtype not in SUPPORTED:
            return f"{str(t.dtype).removeprefix('torch.')} tensors: the kernels read float32, float16 and bfloat16"
    return triton_error()


def available(*tensors: torch.Tensor) -> bool:
    return why_not(*tensors) is None


@functools.cache
def jit(fn, interpret: bool):
    """`triton.jit(fn)`, compiled or for the interpreter, whatever TRITON_INTERPRET says now."""
    import triton
    with triton.knobs.runtime.scope():     # restores the knob and the environment after
        triton.knobs.runtime.interpret = interpret
        return triton.jit(fn)


def kernel(fn):
    """The launchable kernel for fn (a plain function written in triton.language) on this call."""
    return jit(fn, interpreting())
