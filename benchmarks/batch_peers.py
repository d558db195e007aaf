"""Batched decode next to llama.cpp's: aggregate tokens/s at batch 1, 8 and 16, in one run.

    python benchmarks/batch_peers.py --model tiny --weights f32 --gguf ~/.cache/gen-peers/gguf/tiny-*-f32.gguf
    python benchmarks/batch_peers.py --model tiny --weights f16 --gguf ~/.cache/gen-peers/gguf/tiny-*-f16.gguf

Issue 11 asks batch 8 on tiny for >= 4x the aggregate tokens/s of batch 1. This puts gen's batch scaling
beside the peer's on the same weights, the same depth and the same threads, rounds alternating:

- llama.cpp: `llama-batched-bench -m GGUF -c B*(D+S) -npp D -ntg S -npl 1,8,16 -t N -fa off
  --output-format jsonl` (built by benchmarks/peers.sh; its S_TG: B*S tokens over the time of S
  decode calls, each B rows of random tokens starting at depth D; no sampling; f16 KV cache);
- gen: the default step form (backend auto), a fresh process per batch size (benchmarks/native_threads.py's
  row): prefill D random tokens per row, 8 untimed steps, then S timed greedy steps; tokens/s = B / the
  median step (fp32 KV cache, gen's default).

Prints one row per batch size (each engine's tokens/s, its ratio to its own batch 1, gen over llama.cpp)
and writes the raw figures as JSON with --json. Not a test: timings depend on the machine; run it quiet.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from common import load_average, options, write_json
from native_threads import run_row

CACHE = Path(os.environ.get("PEERS_CACHE", Path.home() / ".cache" / "gen-peers"))


def default_batched_bench() -> str:
    """llama-batched-bench as benchmarks/peers.sh builds it (the newest build directory in the cache)."""
    found = sorted(CACHE.glob("build-llama.cpp-*/bin/llama-batched-bench"), key=lambda p: p.stat().st_mtime)
    return str(found[-1]) if found else ""


def llama_batched(binary: str, gguf: str, batches: list[int], depth: int, steps: int, threads: int) -> dict[int, float]:
    """S_TG (aggregate decode tokens/s) per batch size, from one llama-batched-bench process."""
    cmd = [binary, "-m", gguf, "-c", str(max(batches) * (depth + steps)), "-b", "2048", "-ub", "512",
           "-npp", str(depth), "-ntg", str(steps), "-npl", ",".join(map(str, batches)), "-t", str(threads),
           "-fa", "off", "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed ({' '.join(cmd)}): {out.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith('{"n_kv_max"')]
    return {r["pl"]: r["speed_tg"] for r in rows}


def gen_batched(model: str, weights: str, batches: list[int], depth: int, steps: int, threads: int) -> dict[int, dict]:
    """gen's default step, tokens/s per batch size (a fresh process each), and the form that ran."""
    out = {}
    for b in batches:
        r = run_row(dict(model=model, name=model, weights=weights, depth=depth, batch=b, threads=threads,
                         steps=steps, repeats=1, busy=[], adapt=["off"]))
        out[b] = {"tokens_per_s": r["conditions"]["quiet"]["tokens_per_s"], "form": r["form"]}
    return out


def main() -> None:
    ap = options(__doc__, model="tiny", weights="f32", batches="1,8,16")
    ap.add_argument("--gguf", required=True, help="the same weights as a GGUF file, for llama.cpp")
    ap.add_argument("--llama-batched-bench", default=default_batched_bench(),
                    help="the binary (default: the newest in $PEERS_CACHE, built by peers.sh)")
    ap.add_argument("--depth", type=int, default=128, help="tokens in each row's context before the timed steps")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (llama.cpp, gen, llama.cpp, ...)")
    ap.add_argument("--json", help="write the raw figures here")
    a = ap.parse_args()
    if not a.llama_batched_bench or not os.access(a.llama_batched_bench, os.X_OK):
        ap.error("no llama-batched-bench: run benchmarks/peers.sh (it builds it) or pass --llama-batched-bench")
    if not Path(a.gguf).is_file():
        ap.error(f"no GGUF file at {a.gguf}")
    batches = [int(b) for b in a.batches.split(",")]
    if 1 not in batches:
        ap.error("--batches must include 1 (the ratios are to batch 1)")
    rounds = []
    for r in range(a.rounds):
        before = load_average()
        peer = llama_batched(a.llama_batched_bench, a.gguf, batches, a.depth, a.steps, a.threads)
        ours = gen_batched(a.model, a.weights, batches, a.depth, a.steps, a.threads)
        rounds.append({"llama.cpp": peer, "gen": ours, "load_before": before, "load_after": load_average()})
        print(f"round {r + 1}: load {before} -> {rounds[-1]['load_after']}", flush=True)

    def med(get, b):
        return statistics.median(get(rd, b) for rd in rounds)

    peer_tps = {b: med(lambda rd, b: rd["llama.cpp"][b], b) for b in batches}
    gen_tps = {b: med(lambda rd, b: rd["gen"][b]["tokens_per_s"], b) for b in batches}
    print(f"\n{a.model} {a.weights}, depth {a.depth}, {a.steps} steps, {a.threads} threads, median of {a.rounds} rounds\n")
    print("| batch | llama.cpp tokens/s | llama.cpp x batch 1 | gen tokens/s | gen x batch 1 | gen form | gen / llama.cpp |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for b in batches:
        print(f"| {b} | {peer_tps[b]:,.0f} | {peer_tps[b] / peer_tps[1]:.2f} | {gen_tps[b]:,.0f} | "
              f"{gen_tps[b] / gen_tps[1]:.2f} | {rounds[-1]['gen'][b]['form']} | {gen_tps[b] / peer_tps[b]:.2f} |")
    if a.json:
        write_json(a.json, {"settings": vars(a), "rounds": rounds, "llama.cpp": peer_tps, "gen": gen_tps})


if __name__ == "__main__":
    main()
