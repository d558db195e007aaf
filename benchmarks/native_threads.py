"""Decode speed of the native step by thread count, quiet and with cores held by busy loops.

    python benchmarks/native_threads.py                        # tiny and stories260K, 1 and 2 threads
    python benchmarks/native_threads.py --models tiny --threads 1,2 --batches 1,8
    python benchmarks/native_threads.py --models tiny --threads default --busy 1,0+1 --repeats 5
    python benchmarks/native_threads.py --models smollm2 --weights gguf --threads default --adapt both

Every (model, weights, depth, batch, threads) row runs in a fresh process (thread pools start
clean) that loads the model once and then alternates, `--repeats` times, a quiet window and one
window per `--busy` condition: `1` starts `taskset -c 1 sh -c 'while :; do :; done'` (a busy loop
pinned on core 1) for the window and stops it (by its pid) after; `0+1` starts one on core 0 and one
on core 1. Each window prefills `depth` random tokens into a fresh state, takes 8 untimed steps, then
times `--steps` greedy decode steps through the default step form (backend auto). Interleaving the
windows in one process keeps the machine's other load (shared VM) the same for quiet and busy.

Per condition it reports the median ms per step over every timed step of every window, tokens/s
(aggregate over the batch) from that median, the mean ms per step (a contended run alternates fast
and slow stretches as the scheduler shares a core: the mean counts the slow ones), the process's CPU
time per step (all its threads: what the step takes from other processes), busy / quiet
speed (ratio of medians, and the spread of that ratio over the repeats), and the share of the
pool's phases that ran on the caller alone (pool.c's adaptive mode). `threads` is a count (PyTorch
gets the same count, as --threads N does) or `default` (the native pool on every core, PyTorch on one:
what `gen` runs). Each row loads through `engine.load` (benchmarks/runs.py) and steps with the run's own
step; the pool's counters and its adaptive switch are internals on purpose (engine.steps.native). `--weights gguf` keeps a GGUF file's blocks as stored
(smollm2: Q4_1). The load average (`uptime`) is printed before and after
each row. Issue 11 asks that decode at the default thread count with one core busy keeps >= 50% of
its quiet speed. The pool's adaptive (solo) mode is off by default (pool.c); `--adapt on` turns it on
(a verdict every 32 phases), `--adapt both` interleaves windows with it on and off (on: conditions
marked /adaptive), each compared with its own quiet windows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"tiny": "tiny", "stories260K": os.path.join(ROOT, "..", "shared", "checkpoints", "stories260K", "hf")}

ROW = r"""
import engine  # before torch: its OpenMP setting (engine/__init__.py) applies
import json, os, statistics, subprocess, sys, time, torch
from engine.steps.native import NativeUnavailableError, pool_adapt, pool_stats
from runs import load_weights
job = json.loads(sys.argv[1])
llm, _ = load_weights(job["model"], job["weights"], dequantize=False,   # threads None: native on every core, PyTorch on 1
                      threads=None if job["threads"] == "default" else int(job["threads"]))
model = llm.model
try:
    pool_stats()
    native = True
except NativeUnavailableError:
    native = False
step, B, depth, n = llm.step, job["batch"], job["depth"], job["steps"]
prompt = torch.randint(0, model.config.vocab_size, (B, depth), generator=torch.Generator().manual_seed(0))

MODES = {"on": {"window": 32}, "off": {}}   # off: the default (pool_adapt())
def window(mode):
    if native:
        pool_adapt(**MODES[mode])
    state = model.init_state(B, depth + n + 16)
    tok = step(prompt, state, last_only=True)[:, -1:].argmax(-1)
    for _ in range(8):
        tok = step(tok, state).argmax(-1)
    if native:
        pool_stats(reset=True)
    times, cpu0 = [], time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        tok = step(tok, state).argmax(-1)
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    st = pool_stats(reset=True) if native else {}
    return times, cpu, st.get("solo_phases", 0), st.get("parallel_phases", 0) + st.get("solo_phases", 0)

def busy_loops(cores):
    return [subprocess.Popen(["taskset", "-c", c, "sh", "-c", "while :; do :; done"]) for c in cores.split("+")]

conds = [(c, a) for c in ["quiet"] + job["busy"] for a in job["adapt"]]
label = lambda c, a: c + ("/adaptive" if a == "on" and len(job["adapt"]) > 1 else "")
res = {label(c, a): {"times": [], "medians": [], "cpu": 0.0, "solo": 0, "phases": 0} for c, a in conds}
window("on")   # warm-up: build, spawn the pool
for _ in range(job["repeats"]):
    for c, a in conds:
        loops = [] if c == "quiet" else busy_loops(c)
        try:
            if loops:
                time.sleep(0.05)   # the loops are running before the window starts
            times, cpu, solo, phases = window(a)
        finally:
            for p in loops:
                p.kill()
                p.wait()
        r = res[label(c, a)]
        r["times"] += times
        r["cpu"] += cpu
        r["medians"].append(statistics.median(times))
        r["solo"] += solo
        r["phases"] += phases
out = {}
for c, r in res.items():
    med = statistics.median(r["times"])
    out[c] = {"ms_per_step": med * 1e3, "tokens_per_s": B / med, "mean_ms_per_step": 1e3 * sum(r["times"]) / len(r["times"]),
              "cpu_ms_per_step": 1e3 * r["cpu"] / len(r["times"]),
              "window_ms": [m * 1e3 for m in r["medians"]], "solo_share": r["solo"] / max(1, r["phases"])}
print(json.dumps({"conditions": out, "form": step.last_form, "fallback": step.fallback}))
"""


def run_row(job: dict) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))   # the row imports runs.py from here
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, here] + [os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", ROW, json.dumps(job)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"row {job} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,stories260K")
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--threads", default="1,2", help="counts, or `default` (native on every core, PyTorch on 1)")
    ap.add_argument("--depths", default="128")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per window")
    ap.add_argument("--repeats", type=int, default=3, help="quiet/busy window rounds per row")
    ap.add_argument("--busy", default="1", help="busy conditions: cores of the busy loops, '+' joined (1 or 0+1)")
    ap.add_argument("--adapt", choices=["on", "off", "both"], default="off",
                    help="pool.c's adaptive (solo) mode, off by default; both: interleaved A/B (on: conditions marked /adaptive)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    busy = a.busy.split(",")
    jobs = [dict(model=MODELS.get(m, m), name=m, weights=w, depth=int(d), batch=int(b),
                 threads=t if t == "default" else int(t), steps=a.steps, repeats=a.repeats, busy=busy,
                 adapt=["on", "off"] if a.adapt == "both" else [a.adapt])
            for m in a.models.split(",") for w in a.weights.split(",") for d in a.depths.split(",")
            for b in a.batches.split(",") for t in a.threads.split(",")]
    print(f"{'model':12} {'weights':7} {'depth':>5} {'B':>2} {'thr':>7} {'cond':>11}  {'ms/step':>8} {'tok/s':>7} "
          f"{'mean ms':>8} {'cpu ms':>7}  {'x quiet':>7} {'per repeat':>16}  {'solo':>5}  load before/after  form")
    rows = []
    for j in jobs:
        before = load()
        r = run_row(j)
        after = load()
        for c, v in r["conditions"].items():
            q = r["conditions"]["quiet" + c[c.index("/"):] if "/" in c else "quiet"]
            ratio = v["tokens_per_s"] / q["tokens_per_s"]
            per = [qm / bm for qm, bm in zip(q["window_ms"], v["window_ms"])]
            spread = f"{min(per):.2f}-{max(per):.2f}" if not c.startswith("quiet") else ""
            print(f"{j['name']:12} {j['weights']:7} {j['depth']:>5} {j['batch']:>2} {j['threads']:>7} {c:>11}  "
                  f"{v['ms_per_step']:8.3f} {v['tokens_per_s']:7.0f} {v['mean_ms_per_step']:8.3f} {v['cpu_ms_per_step']:7.3f}  {ratio:7.2f} "
                  f"{spread:>16}  {v['solo_share']:5.0%}  {before} / {after}  {r['form']}")
            v["x_quiet"] = ratio
        rows.append({**j, **r, "load_before": before, "load_after": after})
    print("cond: quiet, or the cores held by busy loops (/adaptive: adaptive mode on); cpu ms: the process's CPU "
          "time per step (every thread); x quiet: speed / quiet speed (medians; per repeat: its range over the "
          "repeats); solo: share of pool phases run on the caller alone (adaptive mode)")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(rows, f, indent=2)
        os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
