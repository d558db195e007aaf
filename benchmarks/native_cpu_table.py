"""Decode cost per token as process CPU time (one thread), batch 1 and batch 8, per model x weights x form.

    python benchmarks/native_cpu_table.py MODEL WEIGHTS DEPTHS [BACKEND]
    python benchmarks/native_cpu_table.py tiny f32 128,2048
    python benchmarks/native_cpu_table.py ../shared/checkpoints/stories260K/hf q8_0 128 torch

Prints one markdown row per depth: | model | weights | backend | depth | B=1 ms | B=1 tok/s | B=8 ms |
B=8 tok/s | B=8 / B=1 | form that ran |. CPU time (`time.process_time`) instead of wall time: on a
shared machine the wall clock swings 5-10x with the neighbours' load, the CPU time of one thread much
less (memory-bandwidth contention still inflates it). For quiet-machine wall-clock numbers use
`gen bench` (benchmarks/native_table.py). The model loads through `engine.load` (one thread, the
given backend: the run's own step; benchmarks/runs.py).
"""
import sys
import time

import engine  # noqa: F401  (before torch: its OpenMP setting, engine/__init__.py, applies)
import torch

from runs import load_weights


def main(name: str, weights: str, depths: list[int], backend: str = "native") -> None:
    llm, _ = load_weights(name, weights, dequantize=False, backend=backend, threads=1)
    model, step = llm.model, llm.step
    V = model.config.vocab_size
    short = name.rstrip("/").split("/")[-2] if "/" in name else name
    for depth in depths:
        per_step = []
        for B in (1, 8):
            state = model.init_state(B, depth + 200)
            tok = step(torch.randint(0, V, (B, depth)), state, last_only=True)[:, -1:].argmax(-1)
            for _ in range(5):
                tok = step(tok, state).argmax(-1)
            n = 100 if depth < 1000 else 40
            t0 = time.process_time()
            for _ in range(n):
                tok = step(tok, state).argmax(-1)
            per_step.append((time.process_time() - t0) / n)
        one, eight = per_step
        print(f"| {short} | {weights} | {backend} | {depth} | {one * 1e3:.3f} | {1 / one:.0f} | {eight * 1e3:.3f} | "
              f"{8 / eight:.0f} | {one * 8 / eight:.1f}x | {step.last_form} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(d) for d in sys.argv[3].split(",")], *(sys.argv[4:5]))
