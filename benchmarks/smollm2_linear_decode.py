"""Decode ms/token and state bytes at 2k and 32k for every row of the smollm2-linear model card.

    python benchmarks/smollm2_linear_decode.py --rounds 3 --out /tmp/sl_bench     # then read the table

Each row is `gen bench` (the commands are printed and kept in the JSON) with every configuration
in a fresh subprocess; a depth is reached by prefilling --prefill-tokens real tokens and repeating
their keys/values up to it (`gen bench --prefill-tokens`, engine/bench/depth.py): decode time
depends on how many keys a step reads, not on their values. The whole set runs --rounds times and
the table keeps, per row and depth, the best (lowest) median decode ms/token over the rounds (the
machine is shared: the best round is the one least disturbed). State bytes are the state's nbytes.

Transfer-only and finetuned maps have the same shapes and the same step, so one timing serves
both rows (the transfer-only maps are not kept by gen linearize).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from common import load_average, options

# (card row, gen bench arguments selecting it)
ROWS = [
    ("softmax", ["--model", "smollm2-linear", "--attention", "softmax"]),
    ("control", ["--model", "smollm2-control", "--attention", "softmax"]),
    ("all linear, elu1", ["--model", "smollm2", "--attention", "linear", "--feature-map", "elu1"]),
    ("all linear, learned", ["--model", "smollm2-linear", "--attention", "linear"]),
    ("hybrid K=2", ["--model", "smollm2-linear", "--attention", "hybrid", "--softmax-layers", "auto:2"]),
    ("hybrid K=4", ["--model", "smollm2-linear", "--attention", "hybrid", "--softmax-layers", "auto:4"]),
    ("hybrid K=8", ["--model", "smollm2-linear", "--attention", "hybrid", "--softmax-layers", "auto:8"]),
    ("window W=16", ["--model", "smollm2-linear", "--attention", "window", "--window", "16"]),
    ("window W=64", ["--model", "smollm2-linear", "--attention", "window", "--window", "64"]),
    ("window W=256", ["--model", "smollm2-linear", "--attention", "window", "--window", "256"]),
    ("hybrid K=8 + window 64", ["--model", "smollm2-linear", "--attention", "hybrid", "--softmax-layers", "auto:8",
                                "--window", "64"]),
    ("hybrid K=8 + window 128", ["--model", "smollm2-linear", "--attention", "hybrid", "--softmax-layers", "auto:8",
                                 "--window", "128"]),
    ("hybrid K=4 + window 256", ["--model", "smollm2-linear", "--attention", "hybrid", "--softmax-layers", "auto:4",
                                 "--window", "256"]),
    ("default (hybrid K=8 + window 256 + 64 sparse keys)", ["--model", "smollm2-linear", "--attention", "default"]),
    ("default without sparse keys", ["--model", "smollm2-linear", "--attention", "default", "--sparse-keys", "0"]),
    ("default without sparse keys, linear branch off", ["--model", "smollm2-linear", "--attention", "default",
                                                        "--sparse-keys", "0", "--feature-map", "zero"]),
]


def run(args, out_json: str) -> dict:
    cmd = ["gen", "bench", *args, "--json", out_json, "--quiet"]
    print("$", " ".join(map(shlex.quote, cmd)), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out_json) as f:
        return json.load(f)


def main() -> None:
    ap = options(__doc__, contexts="2048,32768", prefill_tokens="512", steps="16", warmup="4", threads="1",
                 backend="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", help="comma-separated row numbers (0-based) to run; default: all")
    ap.add_argument("--out", required=True, help="directory for each run's JSON and the summary")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    common = ["--contexts", a.contexts, "--prefill-tokens", a.prefill_tokens, "--steps", a.steps,
              "--warmup", a.warmup, "--threads", a.threads, "--backend", a.backend]
    rows = ROWS if a.rows is None else [ROWS[int(i)] for i in a.rows.split(",")]
    best: dict = {}
    for r in range(a.rounds):
        for i, (name, args) in enumerate(rows):
            before = load_average()
            rep = run(args + common, os.path.join(a.out, f"round{r}_row{ROWS.index((name, args))}.json"))
            for rec in rep["results"]:
                key = (name, rec["context"])
                cell = best.setdefault(key, {"runs": [], "state_bytes": rec["state_bytes"],
                                             "state_bytes_formula": rec["state_bytes_formula"],
                                             "step_form": rec["step_form"], "configuration": rec["configuration"],
                                             "command": rep["settings"]["command"]})
                cell["runs"].append({"median_ms": rec["decode_ms_per_token"], "min_ms": rec["decode_ms_per_token_min"],
                                     "load_before": before, "load_after": load_average()})
    contexts = [int(c) for c in a.contexts.split(",")]
    soft = {c: min(x["median_ms"] for x in best[("softmax", c)]["runs"]) for c in contexts if ("softmax", c) in best}
    lines = ["| row | step | " + " | ".join(f"state {c}" for c in contexts) + " | "
             + " | ".join(f"ms/token {c} (x softmax)" for c in contexts) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in contexts * 2) + " |"]
    for name, _ in rows:
        cells = [best.get((name, c)) for c in contexts]
        if not all(cells):
            continue
        ms = [min(x["median_ms"] for x in cell["runs"]) for cell in cells]
        rel = [f" ({m / soft[c]:.2f}x)" if c in soft else "" for m, c in zip(ms, contexts)]
        lines.append(f"| {name} | {cells[0]['step_form']} | "
                     + " | ".join(f"{cell['state_bytes'] / 2**20:.2f} MiB" for cell in cells) + " | "
                     + " | ".join(f"{m:.1f}{x}" for m, x in zip(ms, rel)) + " |")
    table = "\n".join(lines)
    print(table)
    summary = {"rows": {f"{k[0]} @ {k[1]}": v for k, v in best.items()}, "table": table,
               "settings": vars(a), "python": sys.version.split()[0]}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
