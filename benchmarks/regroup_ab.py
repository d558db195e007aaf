"""Regrouping a running batch (what the server does whenever a request joins or leaves) in two
checkouts side by side: `select_rows` keeping 15 rows of 16 and `concat` adding one row, on a KV
cache shaped like SmolLM2-135M's (30 layers, 3 KV heads of 64, fp32) and like tiny's.

    git worktree add /tmp/old REV && python benchmarks/regroup_ab.py /tmp/old

Each checkout runs in its own process (PYTHONPATH set to that checkout, and the process checks that
its `engine` came from there), alternating round by round; prints the median ms per call.
Not a test: timings depend on the machine. It times an internal on purpose (engine.attention.softmax's
KVState, what the server's scheduler calls), in whichever checkout it is given.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"smollm2": (30, 3, 64, 300, 200), "tiny": (6, 8, 32, 140, 70)}   # layers, kv heads, head dim, capacity, slots
RUN = """
import json, os, sys, time, torch
import engine
from engine.attention.softmax import KVState
here = os.path.dirname(os.path.dirname(os.path.realpath(engine.__file__)))
if here != os.path.realpath(sys.argv[1]):
    sys.exit(f"engine was imported from {here}, not from {sys.argv[1]}")
L, H, D, cap, n = json.loads(sys.argv[2])
s = KVState.allocate_shape(L, 16, H, cap, D, "cpu", torch.float32)
s.k.normal_(); s.v.normal_(); s.slots = n; s.lengths.fill_(n)
one = KVState.allocate_shape(L, 1, H, cap, D, "cpu", torch.float32); one.slots = 20; one.lengths.fill_(20)
keep = [i for i in range(16) if i != 5]
kept = s.select_rows(keep)
def ms(f, k=20):
    f(); t0 = time.perf_counter()
    for _ in range(k): f()
    return (time.perf_counter() - t0) / k * 1e3
print(json.dumps([ms(lambda: s.select_rows(keep)), ms(lambda: KVState.concat([kept, one], max_len=cap))]))
"""


def main() -> None:
    old = Path(sys.argv[1]).resolve()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for name, shape in SHAPES.items():
        times = {"old": [], "new": []}
        for _ in range(rounds):
            for label, root in (("old", old), ("new", ROOT)):
                env = dict(os.environ, PYTHONPATH=str(root))   # this checkout's engine, nothing else's
                out = subprocess.run([sys.executable, "-c", RUN, str(root), json.dumps(shape)], capture_output=True,
                                     text=True, env=env, cwd=root)   # (-c puts the working directory first)
                if out.returncode != 0:
                    raise SystemExit(f"{root}: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
                times[label].append(json.loads(out.stdout))
        med = {k: [statistics.median(t[i] for t in v) for i in range(2)] for k, v in times.items()}
        print(f"{name:8} select 15 of 16: old {med['old'][0]:7.1f} ms  new {med['new'][0]:7.1f} ms   "
              f"concat 15 + 1: old {med['old'][1]:7.1f} ms  new {med['new'][1]:7.1f} ms")


if __name__ == "__main__":
    main()
