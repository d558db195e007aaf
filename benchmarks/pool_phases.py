"""Where a multi-threaded native decode step spends its time: the thread pool's counters (issue 11).

    python benchmarks/pool_phases.py [MODEL] [--weights gguf] [--threads 1,2] [--steps 128] [--rounds 2]

Per thread count: ms/token (greedy ids, batch 1, depth ~0, after an 8-step warm-up), pool phases per
token, chunks per phase, the share of chunks the calling thread ran, chunks it stole from a late
worker, the phases' wall time per token and the caller's wait for the workers' last chunks per token
(`engine.steps.native.pool_stats`). Step time minus phase time = the serial work between phases
plus the Python call. The model loads through `engine.load` (bandwidth_floor.load); the pool's
counters are an internal on purpose (engine.steps.native.pool_stats: what this script measures).
"""
from __future__ import annotations

import time

import engine  # noqa: F401  (before torch: its OpenMP setting, engine/__init__.py, applies)
import torch

from bandwidth_floor import load, model_args
from engine.steps.native import pool_stats
from runs import with_run


def main() -> None:
    ap = model_args(__doc__, "gguf", 2)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    llm, kind = load(args.model, args.weights)
    model = llm.model
    V, n = model.config.vocab_size, args.steps
    ids = torch.randint(0, V, (1, n + 12), generator=torch.Generator().manual_seed(0))
    for _ in range(args.rounds):
        for t in (int(x) for x in args.threads.split(",")):
            step, state = with_run(llm, threads=t).step, model.init_state(1, n + 16)
            step(ids[:, :4], state)
            for i in range(4, 12):
                step(ids[:, i:i + 1], state)
            pool_stats(reset=True)
            t0 = time.perf_counter()
            for i in range(12, n + 12):
                step(ids[:, i:i + 1], state)
            ms = (time.perf_counter() - t0) / n * 1e3
            s = pool_stats(reset=True)
            phases, chunks = s["parallel_phases"], max(1, s["chunks"])
            print(f"{args.model} {kind} threads {t}: {ms:.2f} ms/token; phases/token {phases / n:.0f}, "
                  f"chunks/phase {chunks / max(1, phases):.1f}, caller ran {s['caller_chunks'] / chunks:.0%}, "
                  f"stolen {s['stolen_chunks']}, phases {s['phase_ns'] / n / 1e6:.2f} ms/token, "
                  f"caller waiting {s['caller_wait_ns'] / n / 1e6:.2f} ms/token", flush=True)


if __name__ == "__main__":
    main()
