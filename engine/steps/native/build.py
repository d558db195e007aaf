"""Compile the native step (gen.h, pool.c, kernels.c, tile.c, qdot.c, decode.c) once and load it with ctypes.

    lib = library()      # raises NativeUnavailableError when it cannot be built

Built with the system C compiler ($CC, else cc, else gcc) into ~/.cache/gen-engine (or
$GEN_ENGINE_CACHE), keyed by the sources' hash, this file's, the flags, the compiler and the CPU (the
library is built with -march=native): source_key. The sources compile in parallel (one compiler per core: ~9 s instead of
~17 s on 2 cores, kernels.c alone takes half), then link into a temporary file that is renamed, so a
concurrent reader never sees half a library; concurrent builders of the same library (two first runs,
a test suite's workers) wait on one lock file and the later ones load what the first built. Flags: -O3
and -fopenmp-simd (vectorised reductions, no -ffast-math), -pthread for the thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.errors import EngineError

try:
    import fcntl
except ImportError:   # pragma: no cover (not POSIX: builders do not wait for each other)
    fcntl = None

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
    """The library's name: a hash of every source and header, this file (how they are built), the flags,
    the compiler (its path, and the size and time of the file it resolves to: an upgrade is another
    compiler) and the CPU."""
    h = hashlib.sha256()
    for name in HEADERS + SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    h.update(Path(__file__).read_bytes())
    try:
        st = os.stat(shutil.which(cc) or cc)
        compiler_file = f"{st.st_size}:{st.st_mtime_ns}"
    except (OSError, TypeError):
        compiler_file = "?"
    h.update(" ".join(FLAGS + [cc, compiler_file, _cpu_id()]).encode())
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
        build(cc, lib)
    try:
        _LIB = ctypes.CDLL(str(lib))
    except OSError as e:
        raise NativeUnavailableError(f"cannot load the native step {lib}: {e}") from None
    return _LIB


def _cores() -> int:
    """Cores this process may run on (its affinity: a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        return os.cpu_count() or 1


def build(cc: str, lib: Path) -> None:
    """Compile SOURCES into `lib` unless another builder did meanwhile: each source on its own compiler
    process (as many at once as there are cores), then one link into a temporary file renamed onto
    `lib`. Builders of the same library take turns on `lib`'s lock file (flock; where the platform or
    the file system has none they do not wait: each writes its own temporary file, the last rename
    wins, every one whole). Any failure leaves neither `lib` nor temporary files and raises
    NativeUnavailableError (the compiler's first error line, or what the cache refused)."""
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lib.with_suffix(".lock"), "a")
    except OSError as e:
        raise NativeUnavailableError(f"cannot write the native step's build cache {lib.parent}: {e}") from None
    with lock:   # closing it releases the lock
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:   # no locks here (an NFS cache without lockd): build without waiting
                pass
        if lib.exists():   # another process built it while this one waited
            return
        try:
            _build(cc, lib)
        except OSError as e:
            raise NativeUnavailableError(f"cannot write the native step's build cache {lib.parent}: {e}") from None


def _build(cc: str, lib: Path) -> None:
    with tempfile.TemporaryDirectory(dir=lib.parent, prefix="build-") as work:
        objs = [str(Path(work) / (s.removesuffix(".c") + ".o")) for s in SOURCES]
        compile_flags = [f for f in FLAGS if f != "-shared"]
        jobs = [[cc, *compile_flags, "-c", "-o", o, str(HERE / s)] for s, o in zip(SOURCES, objs)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), _cores()))) as pool:
            results = list(pool.map(_compile, jobs))
        tmp = str(Path(work) / "decode.so")
        if all(r.returncode == 0 for r in results):
            results.append(_compile([cc, *FLAGS, "-o", tmp, *objs, "-lm"]))
        failed = next((r for r in results if r.returncode != 0), None)
        if failed is not None:
            first = next((ln for ln in failed.stderr.splitlines() if "error" in ln), None) or \
                (failed.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailableError(f"compiling the native step with {cc} failed: {first}")
        os.replace(tmp, lib)


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise NativeUnavailableError(f"cannot run the C compiler {cmd[0]}: {e}") from None
