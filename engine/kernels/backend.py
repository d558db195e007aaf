"""Whether the Triton kernels can run, and the kernels themselves, built on first use.

Triton is imported lazily (it is optional, and importing it costs ~0.5 s): `why_not()` answers
without importing it where the tensors alone decide. The kernels run on CUDA tensors, or on CPU
tensors under Triton's interpreter, which CI uses to check them without a GPU. Triton decides at
its import whether its own library runs interpreted, so TRITON_INTERPRET=1 must be set before
triton is first imported in the process (tests/test_kernels.py runs those tests in a subprocess).
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)   # the tensors the kernels read


def interpreting() -> bool:
    """TRITON_INTERPRET set (read as Triton reads it: 1, true or on)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


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


@functools.cache
def triton_interpreted() -> bool:
    """Whether triton was imported under TRITON_INTERPRET (its library then runs interpreted only)."""
    import triton.language as tl
    return type(tl.zeros).__name__ == "InterpretedFunction"


def why_not(*tensors: torch.Tensor) -> str | None:
    """None when the Triton kernels run on these tensors; else the one-line reason the torch path runs."""
    if torch.compiler.is_compiling():   # backend "compiled": dynamo cannot trace the launchers
        return "under torch.compile: the torch form is traced (inductor fuses it into its own kernel)"
    device = tensors[0].device
    if device.type != "cuda" and not interpreting():
        return f"tensors on {device.type}: the Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1)"
    for t in tensors:
        if t.dtype not in SUPPORTED:
            return f"{str(t.dtype).removeprefix('torch.')} tensors: the kernels read float32, float16 and bfloat16"
    reason = triton_error()
    if reason is None and device.type != "cuda" and not triton_interpreted():
        reason = "triton was imported before TRITON_INTERPRET=1 was set: set it before the first import"
    return reason


def available(*tensors: torch.Tensor) -> bool:
    return why_not(*tensors) is None


def jit(fn):
    """`triton.jit` for the kernel sources, compiled or interpreted as triton's own library is
    (whatever TRITON_INTERPRET says by the time a source module is first imported)."""
    import triton
    with triton.knobs.runtime.scope():     # restores the knob and the environment after
        triton.knobs.runtime.interpret = triton_interpreted()
        return triton.jit(fn)


def kernel(source: str, name: str):
    """The launchable kernel `name` of the module engine.kernels.<source>. The kernel sources import
    triton at their top, so they are imported here, on first use (a cached module lookup after): triton
    is optional and slow to import. The deferral hides no cycle: nothing they import imports back."""
    return getattr(importlib.import_module(f"engine.kernels.{source}"), name)
