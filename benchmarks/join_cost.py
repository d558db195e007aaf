"""What a long prompt's row costs when it joins a running batch (issue 29's stall at a prompt's end):
on KV caches shaped like SmolLM2-135M's (30 layers, 3 KV heads of 64, fp32), the time of
`KVState.select_rows` (the prefix cache's copy of the prompt's state, before it kept the state
itself), of `KVState.concat` (the join: every running row right-aligned to the long one) and of the
joined cache's allocation alone.

    python benchmarks/join_cost.py --prompts 1024,4096 --streams 1,16

Running rows hold 40 slots with room for 800 more; the joined batch's capacity is the prompt + 800.
Prints the minimum and median of 5 calls in ms. Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.attention.softmax import KVState

L, HKV, D = 30, 3, 64   # SmolLM2-135M


def state(batch: int, slots: int, capacity: int) -> KVState:
    s = KVState.allocate_shape(L, batch, HKV, capacity, D, "cpu", torch.float32)
    s.k[:, :, :, :slots].normal_()
    s.v[:, :, :, :slots].normal_()
    s.slots = slots
    s.lengths.fill_(slots)
    s._after_regroup()
    return s


def timed(f, n: int = 5) -> str:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return f"{1e3 * min(ts):.1f} / {1e3 * statistics.median(ts):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="1024,4096")
    ap.add_argument("--streams", default="1,16")
    a = ap.parse_args()
    print("| prompt | running rows | cache copy ms | join ms | allocation ms | joined cache MB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for P in (int(p) for p in a.prompts.split(",")):
        long = state(1, P, P)
        for B in (int(b) for b in a.streams.split(",")):
            pool, cap = state(B, 40, 840), P + 800
            mb = (B + 1) * cap * L * HKV * D * 4 * 2 / 1e6
            print(f"| {P} | {B} | {timed(lambda: long.select_rows([0], max_len=P))} | "
                  f"{timed(lambda: KVState.concat([pool, long], max_len=cap))} | "
                  f"{timed(lambda: KVState.allocate_shape(L, B + 1, HKV, cap, D, 'cpu', torch.float32, zero=False))} | "
                  f"{mb:.0f} |", flush=True)


if __name__ == "__main__":
    main()
