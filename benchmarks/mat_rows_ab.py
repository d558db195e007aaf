"""The native float matmul (`mat_rows`) of two builds side by side: a git revision's and the working tree's.

    python benchmarks/mat_rows_ab.py --base e405423 --weights f16

Both libraries are compiled here with the native step's own flags (engine/steps/native/build.py), the
base one from `git show BASE:engine/steps/native/<file>`, and called in one process, alternating
round by round on the same matrices (tiny's shapes by default: qkv 768x256, gate/up 672x256, down
256x672, lm_head 4096x256), so the machine's noise falls on both alike. Prints the median time per
call, GMAC/s, the speed-up and each build's worst relative error against a float64 reference. One
thread, weights in cache: a kernel's speed, not a step's.

It measures an internal on purpose (the C kernel, through its ctypes `Mat` and the build's flags), so it
imports engine.steps.native; the "new" build is the sources of the engine this interpreter imports
(the working tree, through the editable install or PYTHONPATH), the base one comes from git.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import engine.steps.native as native
from engine.steps.native import Mat
from engine.steps.native.build import FLAGS, HEADERS, SOURCES, compiler

NATIVE = Path(native.__file__).resolve().parent          # the sources of the engine imported here
ROOT = NATIVE.parents[2]                                 # its checkout (git show reads the base from it)

TYPES = {"f32": (torch.float32, 0), "f16": (torch.float16, 1), "bf16": (torch.bfloat16, 2)}
SRC = "engine/steps/native"


def build(files: dict[str, bytes], out: Path) -> ctypes.CDLL:
    d = out.parent / (out.stem + "-src")
    d.mkdir()
    for name, text in files.items():
        (d / name).write_bytes(text)
    subprocess.run([compiler() or "cc", *FLAGS, "-o", str(out), *[str(d / s) for s in SOURCES]], check=True)
    lib = ctypes.CDLL(str(out))
    lib.mat_rows.argtypes = [ctypes.POINTER(Mat), ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision of the old build")
    ap.add_argument("--weights", choices=list(TYPES), default="f16")
    ap.add_argument("--shapes", default="768x256,672x256,256x672,4096x256")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    names = SOURCES + HEADERS
    with tempfile.TemporaryDirectory() as tmp:
        old = build({n: subprocess.run(["git", "show", f"{a.base}:{SRC}/{n}"], cwd=ROOT, check=True,
                                       capture_output=True).stdout for n in names}, Path(tmp) / "old.so")
        new = build({n: (NATIVE / n).read_bytes() for n in names}, Path(tmp) / "new.so")
        libs = {"old": old, "new": new}
        dtype, code = TYPES[a.weights]
        g = torch.Generator().manual_seed(0)
        print(f"mat_rows, {a.weights} weights, 1 thread: {a.base} (old) vs {ROOT} (new)")
        for shape in a.shapes.split(","):
            rows, cols = map(int, shape.split("x"))
            w = torch.randn(rows, cols, generator=g).to(dtype)
            m = Mat(w.data_ptr(), code, rows, cols)
            for B in map(int, a.batches.split(",")):
                x = torch.randn(B, cols, generator=g)
                outs = {n: torch.zeros(B, rows) for n in libs}
                times = {n: [] for n in libs}
                for _ in range(a.rounds):
                    for n, lib in libs.items():
                        t0 = time.perf_counter()
                        for _ in range(10):
                            lib.mat_rows(ctypes.byref(m), 0, rows, x.data_ptr(), cols, B, outs[n].data_ptr(), rows, 0)
                        times[n].append((time.perf_counter() - t0) / 10)
                ref = x.double() @ w.double().T
                err = {n: ((o.double() - ref).abs().max() / ref.abs().max()).item() for n, o in outs.items()}
                us = {n: statistics.median(t) * 1e6 for n, t in times.items()}
                gmac = {n: rows * cols * B / (us[n] * 1e3) for n in us}
                print(f"{rows}x{cols} B={B:2}: old {us['old']:8.1f} us ({gmac['old']:5.1f} GMAC/s)  "
                      f"new {us['new']:8.1f} us ({gmac['new']:5.1f})  x{us['old'] / us['new']:.2f}  "
                      f"error {err['old']:.1e} / {err['new']:.1e}")


if __name__ == "__main__":
    main()
