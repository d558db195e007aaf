"""Chunked prefill: what a chunk size costs the prompt and what it saves the streams already running.

    python benchmarks/prefill_chunk.py --model smollm2 --chunks 8,16,32,64,0 --paths softmax,linear --streams 1,16

Part 1, per chunk size: prefill tokens/s of a `--prompt`-token prompt fed through the stepper, and the
median time of one chunk. Part 2, per chunk size, path and number of running streams: the server's
scheduler (in-process) decodes N greedy streams; once they run, a `--prompt`-token prompt is
admitted; the streams' inter-token gaps while it is fed are compared with their median gap before it
came (issue 29's target: worst <= 3x median), and with a control run: the same streams with no long
prompt, their median gap over the same tokens, and each gap against the control's at the same token
(the median of the 33 control gaps around it): a stream's step grows with its context (SmolLM2, one
stream: 2.7 ms at 20 tokens, ~8 ms at 3k), with or without the prompt, so the gap the admission adds
is the gap beyond the control's at that token. Chunk 0 = the whole prompt in one block (no chunking).
With `--long-tokens N` (> 1) the long prompt goes on decoding N tokens: its row joins the running
streams' batch (a KV row over 8 MB a few layers a step: engine.serve.scheduler.STAGE_BYTES), and the
gaps are counted until it ends; the default (1) ends it at its first token, so the join is not measured. The
gaps table also gives the median gap while the prompt is admitted and the three worst, with when
each began relative to the long prompt's first token (< 0: while it was fed).
Prints one table per part and, with --json, writes the records. The model loads through `engine.load`;
each chunk size is its run's `prefill_chunk` (benchmarks/runs.py `with_run`, a fresh step); the
server's scheduler is driven directly, an internal on purpose (what part 2 measures).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from engine import load
from engine.sampling import SamplingParams
from engine.serve.scheduler import PREFILL_SHARE, Job, Scheduler
from runs import with_run


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n,), generator=g).tolist()


def prefill_rate(llm, path: str, chunk: int, n: int) -> dict:
    model = llm.model
    step = with_run(llm, prefill_chunk=chunk).step
    ids = torch.tensor([prompt_ids(n, model.config.vocab_size)])
    state = model.init_state(1, n + 1, path)
    step(ids[:, :16], model.init_state(1, 17, path), last_only=True)      # warm-up (native build, pool)
    times, c = [], chunk or n
    t0 = time.perf_counter()
    for s in range(0, n, c):
        t = time.perf_counter()
        step(ids[:, s:s + c], state, last_only=True)
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    return {"chunk": chunk, "path": path, "prompt": n, "prefill_tokens_per_s": n / total,
            "chunk_ms_median": 1e3 * statistics.median(times)}


class Stream:
    def __init__(self):
        self.times = []

    def __call__(self, event):
        self.times.append(time.perf_counter())


def run_streams(llm, path: str, chunk: int, streams: int, before: int, max_tokens: int, long=None,
                share: float = PREFILL_SHARE):
    """N greedy streams on the server's scheduler; once each has `before` tokens, `long` (prompt ids,
    tokens to decode) is admitted and the streams go on until it ends; without `long` they go on for
    `max_tokens`. Returns (each stream's token times, admitted time, the long prompt's token times)."""
    step = with_run(llm, prefill_chunk=chunk).step
    sched = Scheduler(llm.model, llm.tokenizer, step, max_batch=streams + 1, prefill_share=share)
    sched.start()
    params = SamplingParams(temperature=0.0)
    runs = [Stream() for _ in range(streams)]
    jobs = [Job(prompt_ids(8, llm.model.config.vocab_size, seed=i + 1), path, params, max_tokens=max_tokens,
                emit=r, ignore_eos=True) for i, r in enumerate(runs)]
    firsts, admitted = [], None
    try:
        for job in jobs:
            sched.submit(job)
        while min(len(r.times) for r in runs) < before:
            time.sleep(0.005)
        admitted = time.perf_counter()
        if long is not None:
            ids, long_tokens = long
            last = threading.Event()

            def long_token(event):
                firsts.append(time.perf_counter())
                if getattr(event, "finish_reason", "failed") is not None:
                    last.set()
            sched.submit(Job(ids, path, params, max_tokens=long_tokens, emit=long_token, ignore_eos=True))
            last.wait(600)
        else:
            while min(len(r.times) for r in runs) < max_tokens:
                time.sleep(0.005)
    finally:
        for job in jobs:
            job.cancel()
        sched.stop()
    return [r.times for r in runs], admitted, firsts


def gaps(llm, path: str, chunk: int, streams: int, n: int, before: int = 20, long_tokens: int = 1,
         share: float = PREFILL_SHARE) -> dict:
    # the streams outlast the admission (under one token per prompt token: a chunk is fed over
    # several steps), and no more: a KV row's room is reserved for its whole max_tokens
    max_tokens = before + n + 512 + long_tokens
    times, admitted, firsts = run_streams(llm, path, chunk, streams, before, max_tokens,
                                          long=(prompt_ids(n, llm.model.config.vocab_size, seed=99), long_tokens),
                                          share=share)
    done = firsts[-1]
    calm, busy, when, spans = [], [], [], []
    for t in times:
        calm += [b - a for a, b in zip(t, t[1:]) if b < admitted]
        idx = [i for i, (a, b) in enumerate(zip(t, t[1:])) if b >= admitted and a <= done]   # overlapping the admission
        busy += [t[i + 1] - t[i] for i in idx]
        when += [t[i] - firsts[0] for i in idx]   # where it began: < 0 while the prompt is fed, >= 0 once it decodes
        spans.append((idx[0], idx[-1] + 1) if idx else (0, 0))
    # the control: the same streams with no long prompt, over the same tokens (a stream's step grows with
    # its context: what the admission itself costs is the gap beyond the control's at that token)
    hi = max(b for _, b in spans) + 1
    control, _, _ = run_streams(llm, path, chunk, streams, before, hi)
    same = [b - a for t, (lo, up) in zip(control, spans) for a, b in zip(t[lo:up], t[lo + 1:up + 1])]
    # each gap against the control's gaps at the same tokens (the median of the 33 around it)
    ratios = []
    for t, c, (lo, up) in zip(times, control, spans):
        cg = [b - a for a, b in zip(c, c[1:])]
        ratios += [(t[i + 1] - t[i]) / statistics.median(cg[max(0, i - 16):i + 17]) for i in range(lo, up)]
    median = statistics.median(calm)
    worst = max(busy) if busy else float("nan")
    control_median = statistics.median(same) if same else float("nan")
    top = sorted(zip(busy, when), reverse=True)[:5]
    return {"chunk": chunk, "path": path, "streams": streams, "prompt": n, "prefill_share": share,
            "median_gap_ms": 1e3 * median,
            "worst_gap_ms": 1e3 * worst, "worst_over_median": worst / median, "ttft_s": firsts[0] - admitted,
            "long_tokens": long_tokens, "busy_median_gap_ms": 1e3 * statistics.median(busy) if busy else None,
            "control_median_gap_ms": 1e3 * control_median, "control_worst_gap_ms": 1e3 * max(same) if same else None,
            "worst_over_control_median": worst / control_median,
            "worst_over_control_same_token": max(ratios) if ratios else None,
            "median_over_control_same_token": statistics.median(ratios) if ratios else None,
            "p99_over_control_same_token": sorted(ratios)[int(0.99 * (len(ratios) - 1))] if ratios else None,
            "gaps_over_3x_control_same_token": sum(r > 3 for r in ratios),
            "top_gaps_ms_at_s": [(round(1e3 * g, 1), round(w, 3)) for g, w in top],
            "tokens_while_admitting": len(busy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--chunks", default="8,16,32,64,0")
    ap.add_argument("--paths", default="softmax,linear")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--long-tokens", type=int, default=1, help="tokens the long prompt decodes (> 1: its row "
                    "joins the running batch, and the join is measured)")
    ap.add_argument("--shares", default=str(PREFILL_SHARE), help="prefill_share values (decode steps' time "
                    "of prompt pieces an iteration)")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    paths, streams = a.paths.split(","), [int(s) for s in a.streams.split(",")]
    llm = load(a.model, threads=a.threads)
    records = []
    print("| path | chunk | prefill tok/s | chunk ms (median) |\n| --- | ---: | ---: | ---: |")
    for path in paths:
        for chunk in chunks:
            r = prefill_rate(llm, path, chunk, min(a.prompt, 1024))
            records.append(r)
            print(f"| {path} | {chunk or 'whole'} | {r['prefill_tokens_per_s']:.0f} | {r['chunk_ms_median']:.1f} |",
                  flush=True)
    print("\n| path | streams | chunk | share | median gap ms | while admitting | worst gap ms | worst / median | "
          "control: median gap ms, same tokens | worst / control | gap / control's at its token: median, worst | "
          "TTFT of the long prompt s | 3 worst gaps ms (s from the long prompt's first token) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for path in paths:
        for s in streams:
            for chunk, share in [(c, float(x)) for c in chunks for x in a.shares.split(",")]:
                r = gaps(llm, path, chunk, s, a.prompt, long_tokens=a.long_tokens, share=share)
                records.append(r)
                top = ", ".join(f"{g} ({w:+.2f})" for g, w in r["top_gaps_ms_at_s"][:3])
                print(f"| {path} | {s} | {chunk or 'whole'} | {share:g} | {r['median_gap_ms']:.1f} | {r['busy_median_gap_ms']:.1f} | "
                      f"{r['worst_gap_ms']:.1f} | {r['worst_over_median']:.1f}x | {r['control_median_gap_ms']:.1f} | "
                      f"{r['worst_over_control_median']:.1f}x | {r['median_over_control_same_token']:.1f}x, "
                      f"{r['worst_over_control_same_token']:.1f}x | {r['ttft_s']:.1f} | {top} |", flush=True)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"model": a.model, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
