"""Decode and prefill speed of a model on `engine.load`'s default step in two checkouts, side by side:
a change that should not cost speed (issue 33's memory work) against the commit before it.

    git worktree add /tmp/old REV && python benchmarks/checkout_ab.py /tmp/old . --model smollm2

Each checkout runs in its own process (PYTHONPATH set to it; the process checks that its `engine`
came from there), alternating round by round. A process loads the model, warms it up, then per
repeat: one generation of 1 token after a --prompt-token prompt (ids spread over the vocabulary:
prefill tokens/s) and one of --tokens tokens after 8 (decode ms/token). Prints each round's medians.
Not a test: timings depend on the machine and what else runs on it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(model: str, threads: int, prompt_len: int, tokens: int, repeats: int) -> dict:
    import engine
    llm = engine.load(model, threads=threads)
    V = llm.model.config.vocab_size
    prompt = [1] + [(7919 * i + 3) % (V - 10) + 10 for i in range(prompt_len - 1)]
    llm.generate(prompt[:20], max_new_tokens=8, temperature=0)   # plans and copies made once
    dec, pre = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompt, max_new_tokens=1, temperature=0)
        pre.append(len(prompt) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        llm.generate(prompt[:8], max_new_tokens=tokens, temperature=0, ignore_eos=True)
        dec.append((time.perf_counter() - t0) / tokens * 1000)
    return {"engine": os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__))),
            "decode_ms": round(statistics.median(dec), 2), "prefill_tok_s": round(statistics.median(pre))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkouts", nargs="+", help="checkout roots (PYTHONPATH for each run)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.model, a.threads, a.prompt, a.tokens, a.repeats)))
        return
    for r in range(a.rounds):
        for root in a.checkouts:
            root = os.path.abspath(root)
            env = {**os.environ, "PYTHONPATH": root}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *a.checkouts, "--child", "--model", a.model,
                                  "--threads", str(a.threads), "--prompt", str(a.prompt), "--tokens", str(a.tokens),
                                  "--repeats", str(a.repeats)], env=env, capture_output=True, text=True, cwd=root)
            if out.returncode != 0:
                sys.exit(f"{root}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'failed'}")
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            if rec["engine"] != root:
                sys.exit(f"{root}: imported engine from {rec['engine']}")
            print(f"round {r + 1} {root}: decode {rec['decode_ms']} ms/token, prefill {rec['prefill_tok_s']} tok/s",
                  flush=True)


if __name__ == "__main__":
    main()
