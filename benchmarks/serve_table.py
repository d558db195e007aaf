"""Markdown tables (as in the README) from benchmarks/serve_bench.py results.

    python benchmarks/serve_table.py docs/serve_bench_tiny.json docs/serve_bench_smollm2.json

Per run: aggregate tokens/s, TTFT and inter-token p50/p99, server peak RSS, the server's CPU
milliseconds per token (its user + system time over the tokens served: less sensitive than wall
time to other processes taking the cores; where recorded, split into the decode thread's time inside
decode steps, the rest of the decode thread, the event loop's thread and the native pool's workers)
and the 1-minute load average when the run ended; then 16 clients against 1 per path (every
interleaved repeat and their median, next to the ratio the decode steps alone allow: wall time in steps
per token at 1 client over that at 16), the 2k-token conversations that fit in the budget, and the soak.
"""
from __future__ import annotations

import json
import statistics
import sys

FIT = "- {path}: a 2,048-token conversation holds {mib:.2f} MiB of state; {fit:,} fit in {budget:g} GiB"
SOAK = ("- soak {seconds:.0f} s, {workers} clients: {completed} completed ({matched} identical to solo, {corrupted} "
        "corrupted), {lost} lost, {disconnected} disconnected, {rejected} rejected; server after: {server_after}")


def table(results: dict) -> str:
    s = results["settings"]
    out = [f"`{results['command']}` (load average at start "
           f"{', '.join(f'{x:.1f}' for x in results['machine']['load_average_at_start'])})", "",
           "| path | clients | tokens/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms | server peak RSS "
           "| server CPU ms/token | of which: in steps / rest of decode thread / event loop / pool workers | load avg |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["runs"]:
        n = max(r["tokens"], 1)
        split = "-"
        if "cpu_s" in r:
            c = {k: 1e3 * v / n for k, v in r["cpu_s"].items()}
            split = (f"{c['in_steps']:.2f} / {c['decode_thread'] - c['in_steps']:.2f} / {c['event_loop']:.2f} / "
                     f"{c['other_threads']:.2f}")
        out.append(f"| {r['path']} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / "
                   f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
                   f"{r['server_peak_rss_mib']:.0f} MiB | {1e3 * r['server_cpu_s'] / n:.2f} | {split} | "
                   f"{r.get('load_average', float('nan')):.1f} |")
    out.append("")
    for path in s["paths"].split(","):
        pairs = []
        for rep in sorted({r.get("repeat", 0) for r in results["runs"]}):
            runs = {r["clients"]: r for r in results["runs"] if r["path"] == path and r.get("repeat", 0) == rep}
            if 1 in runs and 16 in runs:
                wall = runs[16]["tokens_per_s"] / runs[1]["tokens_per_s"]
                cpu = (runs[1]["server_cpu_s"] / runs[1]["tokens"]) / (runs[16]["server_cpu_s"] / runs[16]["tokens"])
                steps = float("nan")
                if all(runs[c].get("loop_tokens") and runs[c].get("steps_wall_s") for c in (1, 16)):
                    steps = ((runs[1]["steps_wall_s"] / runs[1]["loop_tokens"])
                             / (runs[16]["steps_wall_s"] / runs[16]["loop_tokens"]))
                pairs.append((wall, cpu, steps))
        if len(pairs) == 1:
            out.append(f"- {path}: 16 clients / 1 client = {pairs[0][0]:.1f}x tokens/s ({pairs[0][1]:.1f}x less server "
                       f"CPU per token)")
        elif pairs:
            out.append(f"- {path}: 16 clients / 1 client = {statistics.median(p[0] for p in pairs):.2f}x tokens/s, "
                       f"median of {len(pairs)} interleaved pairs ({', '.join(f'{p[0]:.2f}' for p in pairs)}); "
                       f"{statistics.median(p[1] for p in pairs):.2f}x less server CPU per token; the decode steps "
                       f"alone (wall ms in steps per token, 1 client over 16): "
                       f"{statistics.median(p[2] for p in pairs):.2f}x ({', '.join(f'{p[2]:.2f}' for p in pairs)})")
    for path, f in results.get("fit_2k", {}).items():
        out.append(FIT.format(path=path, mib=f["state_bytes_2k"] / 2 ** 20, fit=f["fit_in_budget"], budget=s["budget_gib"]))
    if results.get("soak"):
        out.append(SOAK.format(**results["soak"]))
    return "\n".join(out)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        with open(name) as f:
            print(table(json.load(f)))
        print()
