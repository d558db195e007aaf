"""Perplexity per weight type, as PyTorch scores it and as the native quantized step computes (issue 11).

    python benchmarks/quant_perplexity.py [MODEL] [--weights f32,f16,bf16,q8_0,q4_0,gguf] [--max-docs 20]
        [--q8 gguf,q8_0] [--data ../shared/data/tinystories/valid.txt]

Each type is scored by engine.evaluate (the same documents, windows and batches as `gen eval`):
  - "dequant": the PyTorch forward, i.e. the stored weights decoded to fp32 (what `gen eval
    --quantize K` reports: the cost of the weights alone);
  - "q8 act" (for the types in --q8): engine.quant.q8_reference, which also rounds every matmul's
    activations to q8 blocks and sums per block as the native decode step (qdot.c) and llama.cpp
    do: the cost of the computation a user's decode runs.
`gguf` is the model's file as stored (SmolLM2: Q4_1 matrices, Q8_0 tied embedding/lm_head);
q8_0/q4_0/q4_1 requantize the matrices and lm_head at load; f16/bf16 load in that dtype. For SmolLM2
the only weights here are that Q4_1 file, so "f32" is its Q4_1 values in fp32, and q8_0/q4_0 are
requantized from them: the deltas are each form's cost relative to those values. Each type loads
through `engine.load` (benchmarks/runs.py; PyTorch keeps its thread count); q8_reference and the
scoring function are internals on purpose (engine.quant, engine.evaluate: what is compared).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from engine.evaluate import evaluate_file
from engine.quant import q8_reference
from runs import load_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--weights", default="f32,f16,bf16,q8_0,q4_0,gguf")
    ap.add_argument("--q8", default="gguf,q8_0", help="types also scored with q8-rounded activations")
    ap.add_argument("--data", default="../shared/data/tinystories/valid.txt")
    ap.add_argument("--max-docs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}; "
          f"{args.data}, first {args.max_docs} documents")
    print("| weights | stored as | math | perplexity | vs f32 | tokens | seconds |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for w in args.weights.split(","):
        llm, stored = load_weights(args.model, w, threads=torch.get_num_threads())
        model, tok = llm.model, llm.tokenizer
        maths = [("dequant", model)] + ([("q8 act", q8_reference(model))] if w in args.q8.split(",") else [])
        for math, m in maths:
            t = time.time()
            r = evaluate_file(m, tok, args.data, attention="softmax", batch_size=args.batch_size, progress=False,
                              max_docs=args.max_docs)
            base = r.perplexity if base is None and w == "f32" else base
            delta = f"{100 * (r.perplexity / base - 1):+.2f}%" if base else "-"
            print(f"| {w} | {stored} | {math} | {r.perplexity:.4f} | {delta} | {r.tokens} | {time.time() - t:.0f} |",
                  flush=True)
        del llm, model, maths


if __name__ == "__main__":
    main()
