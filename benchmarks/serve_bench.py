"""Load test of `gen serve`: concurrent streaming clients, both attention paths, and a soak with disconnects.

    python benchmarks/serve_bench.py --model tiny --clients 1,4,16,64 --out docs/serve_bench_tiny.json
    python benchmarks/serve_bench.py --model tiny --clients 1,16 --repeat 5 --soak 0   # the 16-vs-1 ratio, interleaved
    python benchmarks/serve_bench.py --model smollm2 --clients 1,4,16 --tokens 32 --soak 0
    python benchmarks/serve_bench.py --model smollm2-linear --paths hybrid,linear --tokens 32 --soak 0
    python benchmarks/serve_table.py docs/serve_bench_tiny.json      # the README's tables

Starts `gen serve` in a subprocess on 127.0.0.1 (a free port), then for each path (`--paths`: softmax,
linear, hybrid: what each request asks in `attention`) and client count
runs N concurrent clients, each streaming `--requests` completions of `--tokens` tokens
(ignore_eos, logprobs=0 so every token is one SSE chunk). Reports aggregate tokens/s (all tokens /
wall time), time to first token and inter-token latency p50/p99, the server's peak RSS during the
run (sampled /proc/PID/status VmRSS), and how many 2k-token conversations fit in `--budget-gib` of
state memory per path (KV cache of 2048 tokens vs the fixed linear state). The soak (`--soak S`
seconds) runs random requests from a fixed set with random client disconnects and checks every
completed one against its solo run: none lost (each finishes, the count is right), none corrupted
(the same tokens), and the server holds no state at the end. Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from common import RawClient, RssSampler, ServerProcess, SSEBuffer, free_port, pct, stream_one  # noqa: F401

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a big bird",
           "Tom had a red ball", "The sun was hot and", "Mom said", "In a small town there lived"]


def gen_serve_cmd(model: str, max_batch: int, max_context: int | None, threads: int | None, max_queue: int,
                  backend: str = "auto") -> list[str]:
    """`gen serve` as the load runs start it ({port}: filled in by ServerProcess)."""
    cmd = [sys.executable, "-m", "cli.main", "serve", "--model", model, "--port", "{port}",
           "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--backend", backend]
    if max_context:
        cmd += ["--max-context", str(max_context)]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd


async def load_run(url: str, path: str, clients: int, requests: int, tokens: int, model: str) -> dict:
    async def worker(c):
        out, client = [], RawClient()
        try:
            for r in range(requests):
                body = {"model": model, "prompt": PROMPTS[(c + r) % len(PROMPTS)], "max_tokens": tokens,
                        "temperature": 0.8, "seed": 1000 * c + r, "stream": True, "logprobs": 0,
                        "ignore_eos": True, "attention": path}
                out.append(await stream_one(client, url, body))
        finally:
            client.close()
        return out
    t = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs]
    wall = time.perf_counter() - t
    ok = [r for r in results if r["status"] == 200]
    n_tokens = sum(len(r["times"]) for r in ok)
    ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {"path": path, "clients": clients, "requests": len(results), "failed": len(results) - len(ok),
            "tokens": n_tokens, "wall_s": wall, "tokens_per_s": n_tokens / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99)}


async def soak(url: str, model: str, seconds: float, workers: int, paths: list[str], seed: int = 0) -> dict:
    """Random requests from a fixed set, random disconnects; completed ones must equal their solo runs."""
    rng = random.Random(seed)
    specs = [{"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": rng.randint(8, 48),
              "temperature": rng.choice([0, 0.8]), "seed": i, "stream": True, "logprobs": 0,
              "ignore_eos": True, "attention": paths[i % len(paths)]} for i in range(16)]
    async with httpx.AsyncClient(timeout=60) as client:
        reference = [await stream_one(client, url, s) for s in specs]      # each alone
        counts = {"completed": 0, "matched": 0, "corrupted": 0, "lost": 0, "disconnected": 0, "rejected": 0}
        deadline = time.monotonic() + seconds

        async def worker(w):
            r = random.Random(seed * 1000 + w)
            while time.monotonic() < deadline:
                i = r.randrange(len(specs))
                leave = r.randint(1, specs[i]["max_tokens"]) if r.random() < 0.3 else None
                got = await stream_one(client, url, specs[i], leave)
                if got.get("disconnected"):
                    counts["disconnected"] += 1
                elif got["status"] == 429:
                    counts["rejected"] += 1
                    await asyncio.sleep(1)
                elif got["status"] != 200 or got["finish_reason"] is None:
                    counts["lost"] += 1
                    counts.setdefault("lost_details", []).append({"spec": i, **{k: got.get(k) for k in
                                                                               ("status", "error", "chunks")}})
                else:
                    counts["completed"] += 1
                    same = got["tokens"] == reference[i]["tokens"] and got["text"] == reference[i]["text"]
                    counts["matched" if same else "corrupted"] += 1
        t = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(workers)))
        counts["seconds"] = time.perf_counter() - t
        for _ in range(100):   # every disconnected sequence must have been freed
            stats = (await client.get(url + "/stats")).json()
            if stats["active"] == 0 and stats["states"] == 0:
                break
            await asyncio.sleep(0.1)
        counts["server_after"] = {k: stats[k] for k in ("active", "states", "queued", "failures", "steps")}
        counts["workers"] = workers
    return counts


def fit_2k(model: str, paths: list[str], budget: int) -> dict:
    """State bytes of one 2048-token conversation per path and how many fit in `budget` bytes."""
    from engine import load
    net = load(model, backend="torch").model
    out = {}
    for path in paths:
        nbytes = net.init_state(1, 2048, attention=path).nbytes
        out[path] = {"state_bytes_2k": nbytes, "fit_in_budget": budget // nbytes}
    return out


def load_with_rss(server: ServerProcess, path: str, n: int, a) -> dict:
    """load_run with the server's peak RSS, the load generator's CPU and the load average after it."""
    client0 = time.process_time()
    with RssSampler(server) as rss:
        run = asyncio.run(load_run(server.url, path, n, a.requests, a.tokens, a.model))
    run.update(server_peak_rss_mib=rss.peak / 2 ** 20, client_cpu_s=time.process_time() - client0,
               load_average=os.getloadavg()[0])   # the machine's cores are shared with the clients (and others)
    return run


def measure(server: ServerProcess, path: str, n: int, a) -> dict:
    """One load run of `n` clients, with the server's peak RSS and CPU: the whole process, its decode
    loop's thread (and, of that, inside decode steps, sampling, delivering tokens: the scheduler's own
    counts), its event loop's thread and the rest (the native pool's workers), and the load generator."""
    stats0, threads0 = httpx.get(server.url + "/stats").json(), server.thread_cpu_s()
    run = load_with_rss(server, path, n, a)
    threads1, stats1 = server.thread_cpu_s(), httpx.get(server.url + "/stats").json()
    per = {tid: cpu - threads0.get(tid, 0.0) for tid, cpu in threads1.items()}
    loop_tid, main_tid = stats1.get("thread_id"), server.proc.pid   # (a server from before these counts: zeros)
    t0, t1 = stats0.get("timing", {}), stats1.get("timing", {})
    timing = {k: t1.get(k, 0.0) - t0.get(k, 0.0) for k in ("step_s", "step_cpu_s", "sample_cpu_s", "deliver_cpu_s",
                                                             "tokens")}
    run.update(server_cpu_s=sum(per.values()), cpu_s={
                   "decode_thread": per.get(loop_tid, 0.0), "event_loop": per.get(main_tid, 0.0),
                   "other_threads": sum(c for t, c in per.items() if t not in (loop_tid, main_tid)),
                   "in_steps": timing["step_cpu_s"], "sampling": timing["sample_cpu_s"],
                   "delivering": timing["deliver_cpu_s"]},
               steps_wall_s=timing["step_s"], loop_tokens=timing["tokens"])
    return run


def llama_server_cmd(binary: str, gguf: str, clients: int, tokens: int, threads: int | None) -> list[str]:
    """llama.cpp's OpenAI-compatible server set as close to `gen serve` as its flags go: a slot per
    client (continuous batching is its default), one KV buffer the slots share, the same threads."""
    threads = threads or os.cpu_count()
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-np", str(clients), "-kvu",
            "-c", str(clients * (tokens + 64)), "-fa", "off", "--no-webui", "-t", str(threads), "-tb", str(threads)]


def measure_peer(server: ServerProcess, n: int, a) -> dict:
    """One load run of `n` clients against the peer server: the same clients and requests as measure()."""
    cpu0 = server.cpu_s()
    run = load_with_rss(server, "softmax", n, a)
    run.update(engine="llama-server", server_cpu_s=server.cpu_s() - cpu0)
    return run


def headline(label: str, run: dict) -> str:
    """A load run's one line: throughput, latencies, peak RSS, failures."""
    return (f"{label} {run['clients']:3d} clients: {run['tokens_per_s']:8.1f} tok/s  "
            f"TTFT p50 {run['ttft_p50_ms']:7.1f} p99 {run['ttft_p99_ms']:7.1f} ms  "
            f"ITL p50 {run['itl_p50_ms']:6.1f} p99 {run['itl_p99_ms']:7.1f} ms  "
            f"RSS {run['server_peak_rss_mib']:.0f} MiB  failed {run['failed']}  load {run['load_average']:.1f}")


def describe_peer(run: dict) -> str:
    return (headline("llama-server", run) +
            f"  server CPU ms/token {1e3 * run['server_cpu_s'] / max(run['tokens'], 1):.3f}")


def describe(model: str, run: dict) -> str:
    n, c = max(run["tokens"], 1), run["cpu_s"]
    ms = {k: 1e3 * v / n for k, v in c.items()}
    return (headline(f"{model} {run['path']:7s}", run) + "\n"
            f"    CPU ms/token: server {1e3 * run['server_cpu_s'] / n:.3f} = decode thread {ms['decode_thread']:.3f} "
            f"(steps {ms['in_steps']:.3f}, sampling {ms['sampling']:.3f}, delivering {ms['delivering']:.3f}, "
            f"rest {ms['decode_thread'] - ms['in_steps'] - ms['sampling'] - ms['delivering']:.3f}) + event loop "
            f"{ms['event_loop']:.3f} + other threads {ms['other_threads']:.3f}; clients {1e3 * run['client_cpu_s'] / n:.3f}; "
            f"{run['wall_s']:.1f} s wall, {100 * run['steps_wall_s'] / run['wall_s']:.0f}% of it in decode steps")


def ratio_16_to_1(runs: list[dict]) -> float | None:
    by = {r["clients"]: r for r in runs}
    return by[16]["tokens_per_s"] / by[1]["tokens_per_s"] if 1 in by and 16 in by else None


def step_ratio_16_to_1(runs: list[dict]) -> float | None:
    """The ratio the decode steps alone allow: wall ms inside steps per token at 1 client over that at 16
    (what 16 clients / 1 client would be if nothing but the steps took time)."""
    by = {r["clients"]: r for r in runs}
    if 1 not in by or 16 not in by or not all(by[c].get("loop_tokens") and by[c].get("steps_wall_s") for c in (1, 16)):
        return None
    return (by[1]["steps_wall_s"] / by[1]["loop_tokens"]) / (by[16]["steps_wall_s"] / by[16]["loop_tokens"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--paths", default="softmax,linear")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backend", default="auto", help="the server's decode step form (gen serve --backend)")
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--soak", type=float, default=120.0, help="soak seconds (0: none)")
    ap.add_argument("--soak-workers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure every client count this many times, interleaved (1, 16, 1, 16, ...)")
    ap.add_argument("--llama-server", default=None, metavar="BIN",
                    help="also measure llama.cpp's llama-server (this binary) on --gguf, softmax only, each client "
                         "count right after gen's (the same clients and requests)")
    ap.add_argument("--gguf", default=None, help="the model as a GGUF file, for --llama-server")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    paths, clients = a.paths.split(","), [int(c) for c in a.clients.split(",")]
    if a.llama_server and not (a.gguf and Path(a.gguf).is_file()):
        ap.error("--llama-server needs --gguf FILE: the same weights as a GGUF file")
    server = ServerProcess(gen_serve_cmd(a.model, max(clients + [a.soak_workers]), a.max_context, a.threads,
                                         4 * max(clients), a.backend))
    peer = None
    if a.llama_server:
        peer = ServerProcess(llama_server_cmd(a.llama_server, a.gguf, max(clients), a.tokens, a.threads))
    results = {"settings": vars(a), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "server_command": " ".join(server.cmd[1:]), "machine": {
                   "cpu_count": os.cpu_count(), "platform": platform.platform(),
                   "load_average_at_start": os.getloadavg()}, "runs": []}
    try:
        for path in paths:
            asyncio.run(load_run(server.url, path, 1, 1, 8, a.model))   # warm-up
            for rep in range(a.repeat):   # client counts interleaved, so each repeat sees similar load
                for n in clients:
                    run = measure(server, path, n, a)
                    run["repeat"] = rep
                    results["runs"].append(run)
                    print(describe(a.model, run), flush=True)
                    if peer is not None and path == "softmax":
                        run = measure_peer(peer, n, a)
                        run["repeat"] = rep
                        results.setdefault("peer_runs", []).append(run)
                        print(describe_peer(run), flush=True)
                pair = [r for r in results["runs"] if r["path"] == path and r["repeat"] == rep]
                ratio, steps = ratio_16_to_1(pair), step_ratio_16_to_1(pair)
                if ratio is not None:
                    print(f"  {path}: 16 clients / 1 client = {ratio:.2f}x (repeat {rep + 1} of {a.repeat}; the decode "
                          f"steps alone: {steps or float('nan'):.2f}x)", flush=True)
                peer_ratio = ratio_16_to_1([r for r in results.get("peer_runs", []) if r["repeat"] == rep])
                if peer_ratio is not None and path == "softmax":
                    print(f"  llama-server: 16 clients / 1 client = {peer_ratio:.2f}x (repeat {rep + 1})", flush=True)
            ratios = [ratio_16_to_1([r for r in results["runs"] if r["path"] == path and r["repeat"] == rep])
                      for rep in range(a.repeat)]
            if ratios and None not in ratios:
                print(f"  {path}: 16 clients / 1 client: median {statistics.median(ratios):.2f}x over {len(ratios)} "
                      f"interleaved pairs ({', '.join(f'{x:.2f}' for x in ratios)}); target >= 6x", flush=True)
            peer_ratios = [ratio_16_to_1([r for r in results.get("peer_runs", []) if r["repeat"] == rep])
                           for rep in range(a.repeat)]
            if path == "softmax" and peer_ratios and None not in peer_ratios:
                print(f"  llama-server: 16 clients / 1 client: median {statistics.median(peer_ratios):.2f}x "
                      f"({', '.join(f'{x:.2f}' for x in peer_ratios)})", flush=True)
        if a.soak > 0:
            s = asyncio.run(soak(server.url, a.model, a.soak, a.soak_workers, paths))
            results["soak"] = s
            print(f"soak {s['seconds']:.0f} s, {s['workers']} clients: {s['completed']} completed "
                  f"({s['matched']} identical to solo, {s['corrupted']} corrupted), {s['lost']} lost, "
                  f"{s['disconnected']} disconnected, {s['rejected']} rejected (429); server after: "
                  f"{s['server_after']}", flush=True)
        results["server_peak_rss_mib"] = server.rss("VmHWM") / 2 ** 20
        results["prefix_cache"] = httpx.get(server.url + "/stats").json()["prefix_cache"]
    finally:
        tail = server.stop()
        if peer is not None:
            results["peer_command"] = " ".join(peer.cmd)
            peer.stop()
    print(f"server log ({server.log.name}) ends: {tail}")
    budget = int(a.budget_gib * 2 ** 30)
    results["fit_2k"] = fit_2k(a.model, paths, budget)
    for path, f in results["fit_2k"].items():
        print(f"{path}: one 2048-token conversation holds {f['state_bytes_2k'] / 2 ** 20:.2f} MiB of state; "
              f"{f['fit_in_budget']} fit in {a.budget_gib:g} GiB")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out + ".tmp"
        Path(tmp).write_text(json.dumps(results, indent=1))
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
