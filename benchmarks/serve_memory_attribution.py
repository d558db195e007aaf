"""Where a server's idle RSS goes after a soak-like load, in-process (issue 29; no HTTP, no client).

    python benchmarks/serve_memory_attribution.py smollm2-linear [--sparse-keys 0] [--rounds 15] [--longs 3]

Opens the server (engine.serve.open_server, its scheduler's own loop thread) and drives it as
benchmarks/serve_soak.py does: a warm-up of 8 prompts (5-40 random ids) on both paths (the baseline),
then 4 threads of those prompts (8-48 tokens, 20% cancelled after a few tokens) beside rounds of 64
two-token prompts and a 1,000-token prompt (--longs). Idle, it reads: the RSS (MiB), the prefix cache
(/stats bytes and entries, the bytes of every tensor reachable from it, the tensors on it that carry
an autograd graph), the native step's plans, glibc's arenas (malloc_info: their size and free bytes,
all arenas), the RSS after malloc_trim(0), after each kind of entry is dropped (heap bytes freed
against the entries' own), and with the cache emptied and trimmed. Prints one JSON record.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import re
import sys
import tempfile
import threading

import torch

from engine.serve import open_server
from engine.serve.schemas import CompletionRequest

LIBC = ctypes.CDLL(None)
LIBC.fopen.restype, LIBC.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
LIBC.fclose.argtypes, LIBC.malloc_info.argtypes = [ctypes.c_void_p], [ctypes.c_int, ctypes.c_void_p]
MiB = 2 ** 20


def rss() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def arenas() -> dict:
    """glibc's arenas, all of them (malloc_info's totals): their size, and what is free in their bins, MiB."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    f = LIBC.fopen(path.encode(), b"w")
    LIBC.malloc_info(0, f)
    LIBC.fclose(f)
    with open(path) as fh:
        xml = fh.read()
    os.unlink(path)
    tail = xml[xml.rfind("</heap>"):]
    free = sum(int(v) for v in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', tail))
    size = int(re.search(r'<system type="current" size="(\d+)"', tail).group(1))
    return {"arenas": xml.count("<heap nr"), "size": size / MiB, "free_in_bins": free / MiB}


def reachable_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through Python references (modules left out: the model's)."""
    seen, out, stack = set(), [], [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, torch.nn.Module)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
        else:
            stack.extend(gc.get_referents(o))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--sparse-keys", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=15, help="requests each of the 4 threads sends")
    ap.add_argument("--longs", type=int, default=3, help="rounds of 64 two-token prompts and a 1,000-token one")
    a = ap.parse_args()
    server = open_server(a.model, max_batch=5, sparse_keys=a.sparse_keys)
    sched, rng = server.scheduler, random.Random(0)
    V = server.llm.model.config.vocab_size
    sched.start()

    def run(ids, path, n, cancel_after=None):
        req = CompletionRequest(model=a.model, prompt=ids, max_tokens=n, temperature=0, ignore_eos=True,
                                **({} if path == "default" else {"attention": path}))
        done, got = threading.Event(), []

        def emit(event):
            got.append(event)
            if getattr(event, "finish_reason", "failed") or (cancel_after and len(got) >= cancel_after):
                done.set()
        job = server.make_job(req, ids, emit, 16)
        sched.submit(job)
        done.wait(600)
        if cancel_after:
            job.cancel()

    def client(w):
        r = random.Random(w)
        for _ in range(a.rounds):
            run(prompts[r.randrange(8)], r.choice(["default", "softmax"]), r.randint(8, 48),
                r.randint(1, 7) if r.random() < 0.2 else None)

    def idle() -> dict:
        while sched.busy:
            threading.Event().wait(0.1)
        threading.Event().wait(1.0)   # the loop's idle trim
        c = sched.cache.stats()
        return {"rss": rss(), "cache": c["bytes"] / MiB, "entries": sum(d["entries"] for d in c["by_path"].values()),
                **arenas()}

    prompts = [[rng.randrange(100, V) for _ in range(rng.randint(5, 40))] for _ in range(8)]
    for ids in prompts:
        for path in ("default", "softmax"):
            run(ids, path, 16)
    out = {"model": a.model, "sparse_keys": a.sparse_keys, "baseline": idle()}
    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for j in range(a.longs):
        for f in range(64):
            run([100 + f + 64 * j, 7], rng.choice(["default", "softmax"]), 1)
        run([rng.randrange(100, V) for _ in range(1000)], ("default", "softmax")[j % 2], 8)
    for t in threads:
        t.join()
    out["after"] = idle()
    LIBC.malloc_trim(0)
    out["after_malloc_trim_rss"] = rss()
    tensors = {t.untyped_storage().data_ptr(): t for t in reachable_tensors(sched.cache.entries)}
    graphed = [t for t in tensors.values() if t.grad_fn is not None]
    out["cache_reachable_tensors"] = {"storages": len(tensors),
                                      "bytes": sum(t.untyped_storage().nbytes() for t in tensors.values()) / MiB,
                                      "with_autograd_graph": len(graphed)}
    out["native_plans"] = sum(len(getattr(f, "plans", ())) for f in server.llm.step.forms)
    del tensors, graphed
    kinds: dict[str, dict] = {}
    for key in list(sched.cache.entries):
        entry = sched.cache.entries[key]
        stored = getattr(entry, "stored", None) or entry.state   # (before the cache packed states: the state)
        kind = f"{type(stored).__name__}, {'1,000' if len(key[1]) >= 1000 else 'short'}-token prompt"
        before, nbytes = arenas(), entry.nbytes / MiB
        del sched.cache.entries[key], entry, stored
        gc.collect()
        after = arenas()
        k = kinds.setdefault(kind, {"entries": 0, "bytes": 0.0, "heap_freed": 0.0})
        k["entries"] += 1
        k["bytes"] += nbytes
        k["heap_freed"] += (before["size"] - before["free_in_bins"]) - (after["size"] - after["free_in_bins"])
    out["entries_dropped"] = kinds
    LIBC.malloc_trim(0)
    out["cache_emptied_trimmed_rss"] = rss()
    sched.stop()
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
