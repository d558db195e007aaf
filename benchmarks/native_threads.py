"""Decode speed of the native step by thread count, quiet and with one core held by a busy loop.

    python benchmarks/native_threads.py                        # tiny and stories260K, 1 and 2 threads
    python benchmarks/native_threads.py --models tiny --threads 1,2,3 --depths 128,2048 --batches 1,8

For every (model, weights, depth, batch, threads) it prefills `depth` random tokens and times
`--steps` greedy decode steps through the default step form (backend auto), reporting the median
ms per step and tokens/s (aggregate over the batch), and the mean ms per step (a contended run
alternates fast and slow stretches as the scheduler shares core 1: the mean counts the slow ones). Then it starts `taskset -c 1 sh -c 'while :;
do :; done'` (a busy loop pinned on core 1), repeats the same rows, stops the loop (by its pid) and
prints contended / quiet. Each row runs in a fresh process so thread pools start clean. Issue 11
asks that contended decode at the default thread count stays >= 50% of its quiet speed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"tiny": "tiny", "stories260K": os.path.join(ROOT, "..", "shared", "checkpoints", "stories260K", "hf")}

ROW = r"""
import json, statistics, sys, time, torch
from engine.loader import load_model
from engine.quant import quantize_model
from engine.steps import Stepper
from engine.threads import set_threads
job = json.loads(sys.argv[1])
set_threads(job["threads"])
dtype = {"f16": "float16", "bf16": "bfloat16"}.get(job["weights"], "float32")
model, _ = load_model(job["model"], dtype=dtype)
if job["weights"].startswith("q"):
    quantize_model(model, job["weights"])
step, B, depth, n = Stepper(model, "auto"), job["batch"], job["depth"], job["steps"]
state = model.init_state(B, depth + n + 16)
prompt = torch.randint(0, model.config.vocab_size, (B, depth), generator=torch.Generator().manual_seed(0))
tok = step(prompt, state, last_only=True)[:, -1:].argmax(-1)
for _ in range(8):
    tok = step(tok, state).argmax(-1)
times = []
for _ in range(n):
    t0 = time.perf_counter()
    tok = step(tok, state).argmax(-1)
    times.append(time.perf_counter() - t0)
med, mean = statistics.median(times), sum(times) / len(times)
print(json.dumps({"ms_per_step": med * 1e3, "tokens_per_s": B / med, "mean_ms_per_step": mean * 1e3,
                  "form": step.last_form, "fallback": step.fallback}))
"""


def run_row(job: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", ROW, json.dumps(job)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"row {job} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,stories260K")
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--depths", default="128")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    jobs = [dict(model=MODELS.get(m, m), name=m, weights=w, depth=int(d), batch=int(b), threads=int(t), steps=a.steps)
            for m in a.models.split(",") for w in a.weights.split(",") for d in a.depths.split(",")
            for b in a.batches.split(",") for t in a.threads.split(",")]
    quiet = [run_row(j) for j in jobs]
    busy = subprocess.Popen(["taskset", "-c", "1", "sh", "-c", "while :; do :; done"])
    try:
        time.sleep(0.5)
        contended = [run_row(j) for j in jobs]
    finally:
        busy.kill()
        busy.wait()
    print(f"{'model':12} {'weights':7} {'depth':>5} {'B':>2} {'thr':>3}  {'quiet ms':>9} {'tok/s':>7}  "
          f"{'busy ms':>9} {'tok/s':>7}  {'busy/quiet':>10}  {'mean ms quiet/busy':>18}  form")
    rows = []
    for j, q, c in zip(jobs, quiet, contended):
        ratio = c["tokens_per_s"] / q["tokens_per_s"]
        print(f"{j['name']:12} {j['weights']:7} {j['depth']:>5} {j['batch']:>2} {j['threads']:>3}  "
              f"{q['ms_per_step']:9.3f} {q['tokens_per_s']:7.0f}  {c['ms_per_step']:9.3f} {c['tokens_per_s']:7.0f}  "
              f"{ratio:10.2f}  {q['mean_ms_per_step']:8.3f}/{c['mean_ms_per_step']:<8.3f}  {q['form']}")
        rows.append({**j, "quiet": q, "contended": c, "contended_over_quiet": ratio})
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other processes share the machine when > ~0.5)")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(rows, f, indent=2)
        os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
