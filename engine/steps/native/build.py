"""Compile the native step (gen.h, pool.c, kernels.c, tile.c, qdot.c, decode.c) once and load it with ctypes.

    lib = library()      # raises NativeUnavailableError when it cannot be built

Built with the system C compiler ($CC, else cc, else gcc) into ~/.cache/gen-engine (or
$GEN_ENGINE_CACHE), keyed by the sources' hash, the flags, the compiler and the CPU (the library
is built with -march=native). Written to a temporary file and renamed, so a concurrent build never
sees half a library. Flags: -O3 and -fopenmp-simd (vectorised reductions, no -ffast-math), -pthread
for the thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.errors import EngineError

HERE = Path(__file__).parent
SOURCES = ["pool.c", "kernels.c", "tile.c", "qdot.c", "attention.c", "linear.c", "decode.c"]
HEADERS = ["gen.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-pthread"]
_LIB = None


class NativeUnavailableError(EngineError, RuntimeError):
    """The native decode step cannot be built or does not apply here."""


def _cpu_id() -> str:
    """What -march=native compiled for: a library built on another CPU is not reused."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def source_key(cc: str) -> str:
    h = hashlib.sha256()
    for name in HEADERS + SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    h.update(" ".join(FLAGS + [cc, _cpu_id()]).encode())
    return h.hexdigest()[:16]


def compiler() -> str | None:
    """The C compiler the step is built with: $CC, else cc, else gcc on PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library() -> ctypes.CDLL:
    """The compiled step, built once per source version (cached on disk, then per process)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    cc = compiler()
    if cc is None:
        raise NativeUnavailableError("the native decode step needs a C compiler (cc or gcc) on PATH; "
                                     "install one or use --backend torch")
    cache = Path(os.environ.get("GEN_ENGINE_CACHE") or Path.home() / ".cache" / "gen-engine")
    lib = cache / f"decode-{source_key(cc)}.so"
    if not lib.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        except OSError as e:
            raise NativeUnavailableError(f"cannot write the native step's build cache {cache}: {e}") from None
        os.close(fd)
        try:
            r = subprocess.run([cc, *FLAGS, "-o", tmp, *[str(HERE / s) for s in SOURCES], "-lm"],
                               capture_output=True, text=True)
        except OSError as e:
            os.unlink(tmp)
            raise NativeUnavailableError(f"cannot run the C compiler {cc}: {e}") from None
        if r.returncode != 0:
            os.unlink(tmp)
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), None) or \
                (r.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailableError(f"compiling the native step with {cc} failed: {first}")
        os.replace(tmp, lib)
    try:
        _LIB = ctypes.CDLL(str(lib))
    except OSError as e:
        raise NativeUnavailableError(f"cannot load the native step {lib}: {e}") from None
    return _LIB
