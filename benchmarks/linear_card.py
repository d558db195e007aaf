"""The one table of weights/smollm2-linear/README.md: every configuration on the six zero-shot tasks,
perplexity on held-out texts, passkey retrieval, decode state and time, against softmax and the control
(the rows that run the `linear/` set: against that set's own control, `smollm2-control-linear`).

    python benchmarks/linear_card.py run OUT --general general.txt --legal legal.txt [--rows softmax,control]
    python benchmarks/linear_card.py run OUT ... --rows linear --linear-model DIR   # a candidate set
    python benchmarks/linear_card.py run OUT ... --rows control_linear --control-linear-model CTL   # its control
    python benchmarks/linear_card.py table OUT [--decode DIR/summary.json] [--bundle card.json]

`run` calls `gen eval` once per (configuration, measurement) and keeps each answer as
OUT/<row>.<measurement>.json, written whole when the command ends: a rerun skips what is there, so an
interrupted grid resumes. Measurements: `tasks` (piqa, hellaswag, arc_easy, arc_challenge, winogrande,
lambada, `--limit`), `stories` / `general` / `legal` (perplexity of the first 40 documents), `pk1k`, `pk2k`
and `pk8k` (passkey, 20 trials, 1,024, 2,048 and 8,182 tokens: 8,182 + the 10 answer tokens fill SmolLM2's
8,192 positions). `table` prints the markdown table from OUT; state bytes and decode ms/token at 32k come from
`benchmarks/smollm2_linear_decode.py`'s summary.json (`--decode`, repeatable), whose row names ROWS gives.

The task average is the metric each task's papers quote: piqa acc_norm, hellaswag acc_norm, arc_easy acc,
arc_challenge acc_norm, winogrande acc, lambada acc.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

# (key, the card's name for it, `gen eval` arguments selecting it, its row in smollm2_linear_decode.py)
ROWS = [
    ("softmax", "softmax (`smollm2`, not finetuned)", ["--model", "smollm2"], "softmax"),
    ("control", "**control**: softmax finetuned alike (`smollm2-control`)", ["--model", "smollm2-control"], "control"),
    ("control_linear", "**control of the `linear/` set**: `smollm2-control` finetuned further alike (`smollm2-control-linear`)",
     ["--model", "smollm2-control-linear"], "control"),
    ("elu1", "all linear, elu1, untrained", ["--model", "smollm2", "--attention", "linear", "--feature-map", "elu1"],
     "all linear, elu1"),
    ("linear", "all linear, learned (`--attention linear`)", ["--model", "smollm2-linear", "--attention", "linear"],
     "all linear, learned"),
    ("hybrid2", "hybrid, 2 softmax layers", ["--model", "smollm2-linear", "--attention", "hybrid",
                                            "--softmax-layers", "auto:2"], "hybrid K=2"),
    ("hybrid4", "hybrid, 4 softmax layers", ["--model", "smollm2-linear", "--attention", "hybrid",
                                            "--softmax-layers", "auto:4"], "hybrid K=4"),
    ("hybrid8", "hybrid, 8 softmax layers", ["--model", "smollm2-linear", "--attention", "hybrid",
                                            "--softmax-layers", "auto:8"], "hybrid K=8"),
    ("window64", "linear + window 64", ["--model", "smollm2-linear", "--attention", "linear", "--window", "64"],
     "window W=64"),
    ("window256", "linear + window 256", ["--model", "smollm2-linear", "--attention", "linear", "--window", "256"],
     "window W=256"),
    ("default", "**the default** (hybrid 8 + window 256 + 64 sparse keys: `smollm2-linear`)", ["--model", "smollm2-linear"],
     "default (hybrid K=8 + window 256 + 64 sparse keys)"),
    ("default_s0", "the default without its sparse cache (`--sparse-keys 0`)",
     ["--model", "smollm2-linear", "--sparse-keys", "0"], "default without sparse keys"),
    ("window_only", "the default without its sparse cache, linear branch off (`--sparse-keys 0 --feature-map zero`)",
     ["--model", "smollm2-linear", "--sparse-keys", "0", "--feature-map", "zero"],
     "default without sparse keys, linear branch off"),
]
TASKS = {"piqa": "acc_norm", "hellaswag": "acc_norm", "arc_easy": "acc", "arc_challenge": "acc_norm",
         "winogrande": "acc", "lambada": "acc"}
PASSKEY = {"pk1k": 1024, "pk2k": 2048, "pk8k": 8182}
# the rows that run the `linear/` set (no window) divide by its own control; every other row by `control`
CONTROL_OF = {"linear": "control_linear", "hybrid2": "control_linear", "hybrid4": "control_linear",
              "hybrid8": "control_linear"}


def measurements(a) -> dict[str, list[str]]:
    """measurement -> the `gen eval` arguments it adds to a row's."""
    texts = {"stories": a.stories, "general": a.general, "legal": a.legal}
    out = {"tasks": ["--task", ",".join(TASKS), "--limit", str(a.limit)]}
    out.update({name: ["--data", path, "--max-docs", "40"] for name, path in texts.items() if path})
    out.update({name: ["--task", "passkey", "--lengths", str(n), "--trials", "20"] for name, n in PASSKEY.items()})
    return out


def run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    keys = a.rows.split(",") if a.rows else [k for k, *_ in ROWS]
    rows = {k: args for k, _, args, _ in ROWS}
    unknown = [k for k in keys if k not in rows]
    if unknown:
        sys.exit(f"linear_card.py: unknown rows {', '.join(unknown)}; known: {', '.join(rows)}")
    wanted = a.only.split(",") if a.only else list(measurements(a))
    models = {"smollm2-linear": a.linear_model, "smollm2-control-linear": a.control_linear_model}   # candidates
    for what, extra in measurements(a).items():      # measurement by measurement: every row's tasks first
        if what not in wanted:
            continue
        for key in keys:
            path = os.path.join(a.out, f"{key}.{what}.json")
            if os.path.exists(path):
                continue
            args = [models.get(x, x) for x in rows[key]]
            cmd = ["gen", "eval", *args, *extra, "--threads", str(a.threads), "--json"]
            print("$", shlex.join(cmd), flush=True)
            t0 = time.perf_counter()
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print(f"  failed (exit {done.returncode}); left for a rerun", flush=True)
                continue
            answer = json.loads(done.stdout)
            answer["card"] = {"command": shlex.join(cmd), "seconds": round(time.perf_counter() - t0, 1)}
            with open(path + ".tmp", "w") as f:
                json.dump(answer, f, indent=1)
            os.replace(path + ".tmp", path)


def read(out: str, key: str, what: str) -> dict | None:
    try:
        with open(os.path.join(out, f"{key}.{what}.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def task_scores(answer: dict | None) -> dict[str, float]:
    if answer is None:
        return {}
    return {t: answer["tasks"][t]["metrics"][m]["value"] for t, m in TASKS.items() if t in answer.get("tasks", {})}


def average(scores: dict[str, float]) -> float | None:
    """The six tasks' mean, or None while any is missing."""
    return sum(scores.values()) / len(TASKS) if len(scores) == len(TASKS) else None


def table(a) -> str:
    decode = {}
    for path in ([a.decode] if isinstance(a.decode, str) else a.decode or []):   # a later summary's rows win
        with open(path) as f:
            summary = json.load(f)
        for name, cell in summary["rows"].items():
            row, _, context = name.rpartition(" @ ")
            if int(context) == 32768:
                decode[row] = (cell["state_bytes"], min(r["median_ms"] for r in cell["runs"]))
    texts = [t for t in ("stories", "general", "legal") if any(read(a.out, k, t) for k, *_ in ROWS)]
    ref = {key: {} for key in ("softmax", "control", *CONTROL_OF.values())}
    for key in ref:
        ref[key]["avg"] = average(task_scores(read(a.out, key, "tasks")))
        for t in texts:
            ppl = read(a.out, key, t)
            ref[key][t] = ppl["perplexity"] if ppl else None
    head = (["configuration"] + list(TASKS) + ["average (x softmax / x its control)"]
            + [f"{t} ppl (x softmax / x its control)" for t in texts]
            + ["passkey 1k", "passkey 2k", "passkey 8k", "state 32k", "ms/token 32k"])
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]

    def versus(value, what, fmt, control="control"):
        if value is None:
            return "-"
        rel = [f"{value / ref[k][what]:.2f}x" if ref[k].get(what) else "-" for k in ("softmax", control)]
        return f"{value:{fmt}} ({' / '.join(rel)})"

    for key, name, _, decode_row in ROWS:
        scores = task_scores(read(a.out, key, "tasks"))
        cells = [f"{scores[t]:.2f}" if t in scores else "-" for t in TASKS]
        control = CONTROL_OF.get(key, "control")
        cells.append(versus(average(scores), "avg", ".3f", control))
        for t in texts:
            ppl = read(a.out, key, t)
            cells.append(versus(ppl["perplexity"] if ppl else None, t, ".2f", control))
        for what, n in PASSKEY.items():
            pk = read(a.out, key, what)
            cell = (pk or {}).get("tasks", {}).get("passkey", {}).get("lengths", {}).get(str(n))
            cells.append(f"{cell['correct']}/{cell['trials']}" if cell else "-")
        state, ms = decode.get(decode_row, (None, None))
        cells += [f"{state / 2**20:.1f} MiB" if state else "-", f"{ms:.1f}" if ms else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="run the grid, skipping what OUT holds")
    r.add_argument("out")
    r.add_argument("--rows", help="comma-separated row keys (default: all): " + ",".join(k for k, *_ in ROWS))
    r.add_argument("--only", help="comma-separated measurements: tasks,stories,general,legal,pk1k,pk2k,pk8k")
    r.add_argument("--stories", default="../shared/data/tinystories/valid.txt")
    r.add_argument("--general", help="held-out general English (the card: held-out fortunes)")
    r.add_argument("--legal", help="licence texts (scripts/eval_texts.py legal)")
    r.add_argument("--limit", type=int, default=100, help="items per task (default: 100)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--linear-model", default="smollm2-linear",
                   help="the linearized model of the rows that name smollm2-linear (a candidate set's directory)")
    r.add_argument("--control-linear-model", default="smollm2-control-linear",
                   help="the control the linear/-set rows divide by (a candidate's own control: the same finetune "
                        "with softmax attention, `gen linearize --control`)")
    t = sub.add_parser("table", help="print the card's table from OUT")
    t.add_argument("out")
    t.add_argument("--decode", action="append", help="summary.json of benchmarks/smollm2_linear_decode.py "
                   "(repeatable: a later file's rows replace an earlier one's)")
    t.add_argument("--bundle", help="also write every cell, the decode summary and the table to this JSON")
    a = ap.parse_args()
    if a.mode == "run":
        run(a)
        return
    text = table(a)
    print(text)
    if a.bundle:
        cells = {name[:-5]: json.load(open(os.path.join(a.out, name))) for name in sorted(os.listdir(a.out))
                 if name.endswith(".json") and name.split(".")[0] in {k for k, *_ in ROWS}}
        decode = [json.load(open(p)) for p in a.decode] if a.decode else None
        with open(a.bundle, "w") as f:
            json.dump({"table": text, "cells": cells, "decode": decode}, f, indent=1)


if __name__ == "__main__":
    main()
