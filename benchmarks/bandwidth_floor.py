"""The memory-bandwidth floor of a decode step, and gen's native decode next to it (issue 11).

    python benchmarks/bandwidth_floor.py [MODEL] [--weights gguf,q8_0,q4_1,f16,f32] [--threads 1,2] [--rounds 5]
    python benchmarks/bandwidth_floor.py smollm2 --weights gguf,q8_0,q4_0,f16,bf16,f32

Bytes read per token: every tensor the native step streams for one token at depth ~0 (the layer
matrices and lm_head in their stored form -- quantized blocks, 16-bit or fp32 -- plus the norm
weights and one embedding row), summed over the loaded model itself. Copy bandwidth: the best of
`--copies` torch copies of a 256 MiB buffer on N threads (bytes copied per second; a copy also
writes them, so this is a conservative, higher floor than a pure read would give). Floor = bytes per
token / copy bandwidth. The table gives gen's ratio to three floors: bytes copied per second
("copy", the loosest), twice that ("r+w": a copy's read plus write traffic, the STREAM convention),
and bytes read per second by a sum over a 256 MiB buffer ("read": a stream that only reads, as the
step does). gen: best-of-`--rounds` native decode tokens/s (batch 1, greedy ids, 128 steps after an
8-step warm-up), alternating thread counts each round; ratio = gen's ms/token / the floor's (issue
11's target: <= 1.3).

`gguf` is the model as its file stores it (SmolLM2: Q4_1 matrices, Q8_0 tied embedding as lm_head);
q8_0/q4_0/q4_1 requantize the matrices and lm_head at load (`--quantize`); f32/f16/bf16 load in that
dtype (benchmarks/runs.py: `engine.load`, then each thread count a run of its own on the same weights;
PyTorch's own pool keeps its count). On a shared machine both numbers move with the neighbours' load:
the script prints the load average before and after.
"""
from __future__ import annotations

import argparse
import os
import time

import engine  # noqa: F401  (before torch: its OpenMP setting, engine/__init__.py, applies)
import torch

from engine.bench.floor import weight_bytes_read
from runs import load_weights, with_run


def _best_seconds(threads: int, repeats: int, fn) -> float:
    """The fastest of `repeats` calls of fn() with torch on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(before)
    return best


def copy_bandwidth(threads: int, copies: int = 8, mib: int = 256) -> float:
    """Bytes copied per second, best of `copies` (torch's parallel copy on `threads` threads)."""
    a = torch.ones(mib << 20, dtype=torch.uint8)
    b = torch.zeros_like(a)   # touched: no page faults in the timing
    return a.numel() / _best_seconds(threads, copies, lambda: b.copy_(a))


def read_bandwidth(threads: int, reads: int = 8, mib: int = 256) -> float:
    """Bytes read per second, best of `reads` sums of a 256 MiB fp32 buffer on `threads` threads: a
    stream that only reads, as a decode step's weights are only read (no write traffic to count)."""
    a = torch.ones(mib << 18)
    return a.numel() * 4 / _best_seconds(threads, reads, a.sum)


def bytes_per_token(model) -> int:
    """What one decode step at depth ~0 streams (engine.bench.floor.weight_bytes_read, which `gen bench`'s
    floor column uses): matrices as stored, norms, one embedding row, the learned maps of linear layers.
    A layer that the model's default state runs linear reads its adapted projections where it has them
    (smollm2-linear: merged q8_0 copies beside the base Q4_1)."""
    return weight_bytes_read(model, model.init_state(1, 8))


def decode_rate(llm, threads: list[int], rounds: int, steps: int = 128) -> dict[int, float]:
    """Best-of-`rounds` native decode tokens/s per thread count, alternating the counts each round."""
    best = {t: 0.0 for t in threads}
    model = llm.model
    V = model.config.vocab_size
    for _ in range(rounds):
        for t in threads:
            step, state = with_run(llm, threads=t).step, model.init_state(1, steps + 64)
            ids = torch.randint(0, V, (1, steps + 12), generator=torch.Generator().manual_seed(0))
            step(ids[:, :4], state)
            for i in range(4, 12):
                step(ids[:, i:i + 1], state)
            t0 = time.perf_counter()
            for i in range(12, steps + 12):
                step(ids[:, i:i + 1], state)
            dt = time.perf_counter() - t0
            if step.last_form != "native":
                raise SystemExit(f"the native step did not run: {step.fallback}")
            best[t] = max(best[t], steps / dt)
    return best


def load(name: str, weights: str):
    """(LLM on the native step, what its matrices are stored as); PyTorch keeps its thread count."""
    return load_weights(name, weights, backend="native", threads=torch.get_num_threads())


def model_args(doc: str, weights: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments this script and pool_phases.py share: model, weights, thread counts, rounds."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--weights", default=weights)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def main() -> None:
    ap = model_args(__doc__, "gguf,q8_0,q4_1,f16,f32", 5)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--no-measure", action="store_true", help="only the floor, no decode runs")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(f"load average before: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}")
    bw = {t: copy_bandwidth(t, args.copies) for t in threads}
    rd = {t: read_bandwidth(t, args.copies) for t in threads}
    print("copy bandwidth (256 MiB, best of %d, bytes copied): " % args.copies
          + ", ".join(f"{t} thread{'s' * (t > 1)} {bw[t] / 1e9:.1f} GB/s" for t in threads)
          + "; read + write traffic: twice that")
    print("read bandwidth (a sum over 256 MiB fp32, best of %d): " % args.copies
          + ", ".join(f"{t} thread{'s' * (t > 1)} {rd[t] / 1e9:.1f} GB/s" for t in threads))
    print("ratio = gen's ms/token / the floor's: copy = bytes per token / bytes copied per s; "
          "r+w = / (2 x bytes copied per s), the STREAM convention; read = / bytes read per s")
    head = "| weights | stored as | MB read / token | " + " | ".join(
        f"floor {t}t tok/s (copy) | gen {t}t tok/s | ratio {t}t copy | ratio {t}t r+w | ratio {t}t read"
        for t in threads) + " |"
    print(head)
    print("|" + "---|" * (3 + 5 * len(threads)))
    for w in args.weights.split(","):
        llm, stored = load(args.model, w)
        nbytes = bytes_per_token(llm.model)
        floor = {t: bw[t] / nbytes for t in threads}
        rate = {} if args.no_measure else decode_rate(llm, threads, args.rounds)
        cells = []
        for t in threads:
            r = rate.get(t)
            ratios = [f / r for f in (floor[t], 2 * floor[t], rd[t] / nbytes)] if r else []
            cells += [f"{floor[t]:.0f}", f"{r:.1f}" if r else "-"] + ([f"{x:.2f}" for x in ratios] or ["-"] * 3)
        print(f"| {w} | {stored} | {nbytes / 1e6:.1f} | " + " | ".join(cells) + " |", flush=True)
        del llm
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
