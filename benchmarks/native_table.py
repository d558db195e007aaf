"""The issue-11 decode table: `gen bench` rows for each model x weights x threads x batch, one markdown table.

    python benchmarks/native_table.py                      # tiny and stories260K, depths 128 and 2048
    python benchmarks/native_table.py --models tiny --weights f32,q8_0 --out docs/native_table.json

Each row is one `gen bench` configuration in a fresh subprocess (the bench's own isolation), with
the default backend (auto: the native step where it applies). tokens/s at batch 8 is the aggregate
of the 8 rows. The step column is the form that actually ran (and the weights it read).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from common import load_average, options, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"tiny": "tiny", "stories260K": os.path.join(ROOT, "..", "shared", "checkpoints", "stories260K", "hf")}


def main() -> None:
    ap = options(__doc__, models="tiny,stories260K", weights="f32,f16,bf16,q8_0,q4_0", threads="1,2",
                 batches="1,8", contexts="128,2048", attention="softmax", backend="auto", steps="64")
    ap.add_argument("--out", help="write all rows as JSON here")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in a.models.split(","):
            for w in a.weights.split(","):
                for t in a.threads.split(","):
                    for b in a.batches.split(","):
                        path = os.path.join(tmp, "r.json")
                        cmd = [sys.executable, "-m", "cli.main", "bench", "--model", MODELS.get(m, m), "--contexts",
                               a.contexts, "--attention", a.attention, "--weights", w, "--threads", t, "--batch", b,
                               "--steps", a.steps, "--backend", a.backend, "--quiet", "--json", path]
                        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                        if r.returncode != 0:
                            print(f"{m} {w} T{t} B{b}: failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
                            continue
                        for res in json.load(open(path))["results"]:
                            rows.append({"model": m, "weights": w, "threads": int(t), "batch": int(b), **res})
                            print(f"| {m} | {w} | {t} | {b} | {res['context']} | {res['decode_tokens_per_s']:.0f} | "
                                  f"{res['decode_ms_per_token']:.3f} | {res['step_form']} |", flush=True)
    print(f"load average at the end: {load_average()}")
    if a.out:
        write_json(a.out, rows)


if __name__ == "__main__":
    main()
