"""gen's perplexity on llama-perplexity's own token windows, and how far its next-token
distributions sit from llama.cpp's on the same file (issue 33: an outside check of the arithmetic).

    llama-perplexity -m F.gguf -f TEXT -c 512 -b 512 --kl-divergence-base F.kld
    python benchmarks/lcpp_perplexity.py F.gguf F.kld [--text TEXT] [--forms torch,q8ref,native]
        [--threads 2] [--json out.json]

llama-perplexity (its default mode) cuts the tokens of the whole text into n_chunk windows of n_ctx
tokens, no overlap (the first token of each replaced by BOS where the vocabulary adds one: SmolLM2's
does not), and scores the targets of the second half of each window only: positions n_ctx/2 ..
n_ctx-2 predict tokens n_ctx/2+1 .. n_ctx-1, so n_ctx/2-1 targets per window, each with at least
n_ctx/2 tokens of context. With --kl-divergence-base it also writes those tokens and, per scored
position, its log-probabilities over the whole vocabulary (16-bit, within 16 nats of the top:
tools/perplexity/perplexity.cpp, log_softmax / process_logits). This script reads that file and
scores the very same tokens and positions with gen, one form at a time:

  torch   the PyTorch forward of `gen eval`: every block decoded to fp32 (engine.quant.dequantize)
  q8ref   engine.quant.q8_reference: activations rounded to q8 blocks, integer dots per block (the
          native step's arithmetic, and llama.cpp's kind of arithmetic: it rounds activations to q8_0
          blocks for Q4_0/Q4_1/Q5_0/Q8_0 and to q8_K super-blocks for the K-quants)
  native  the C step itself, as `gen generate` runs it: the first half of each window prefilled
          (engine.steps.Stepper, default activations), then one decode step per scored position

For each form: perplexity over the same targets, and against llama.cpp's distributions the mean
KL divergence KL(llama || gen) (over tokens within 16 nats of the top, as llama-perplexity
--kl-divergence computes it), the share of positions whose top token is the same, and the largest
|difference| in the target's probability. llama.cpp's own perplexity is read back from the file
(its stored target log-probs: equal to its printed estimate up to the 16-bit rounding).
With --text, also checks that gen's tokenizer gives llama.cpp's tokens for that text.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

import engine
from engine.quant import q8_reference
from engine.steps import make_step

MAGIC = b"_logits_"


def read_base(path: str) -> dict:
    """llama-perplexity --kl-divergence-base FILE: n_ctx, n_vocab, n_chunk, tokens (n_chunk, n_ctx) and
    the stored rows as (n_chunk, n_ctx - 1 - n_ctx // 2, nv) uint16 (a memory map: the file is large)."""
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise SystemExit(f"{path}: not a llama-perplexity --kl-divergence-base file (no '_logits_' header)")
        n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(f.read(12), dtype=np.int32))
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = n_ctx - 1 - n_ctx // 2
    size = 8 + 12 + 4 * n_chunk * n_ctx + 2 * n_chunk * rows * nv
    if os.path.getsize(path) < size:
        raise SystemExit(f"{path}: {os.path.getsize(path)} bytes, {size} expected for {n_chunk} windows of {n_ctx} "
                         f"over {n_vocab} tokens: cut short (did llama-perplexity finish?)")
    offset = 8 + 12
    tokens = np.memmap(path, dtype=np.int32, mode="r", offset=offset, shape=(n_chunk, n_ctx))
    offset += tokens.nbytes
    probs = np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=(n_chunk, rows, nv))
    return dict(n_ctx=n_ctx, n_vocab=n_vocab, n_chunk=n_chunk, tokens=tokens, rows=probs)


def base_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """Stored rows (R, nv) uint16 -> log-probabilities (R, n_vocab) float64: the first 4 uint16 hold two
    fp32, scale and the smallest log-prob kept; entry i = scale * q_i + that minimum."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32).astype(np.float64)   # (R, 2)
    return head[:, :1] * rows[:, 4:4 + n_vocab].astype(np.float64) + head[:, 1:2]


def compare(gen_logp: np.ndarray, base_logp: np.ndarray, targets: np.ndarray) -> dict:
    """Sums over positions: both sides' target NLL, KL(base || gen) as llama.cpp sums it (entries with
    base log-prob > -16), same top token, largest |p_target difference|."""
    idx = np.arange(len(targets))
    nll_gen = -gen_logp[idx, targets]
    nll_base = -base_logp[idx, targets]
    keep = base_logp > -16.0
    p_base = np.where(keep, np.exp(base_logp), 0.0)
    kld = (p_base * np.where(keep, base_logp - gen_logp, 0.0)).sum(axis=1)
    return dict(nll=float(nll_gen.sum()), nll_base=float(nll_base.sum()), kld=float(kld.sum()),
                kld_max=float(kld.max()), same_top=int((gen_logp.argmax(1) == base_logp.argmax(1)).sum()),
                dp_max=float(np.abs(np.exp(-nll_gen) - np.exp(-nll_base)).max()), count=len(targets))


def window_logits(form: str, model, step, ids: torch.Tensor, first: int) -> torch.Tensor:
    """Logits (n_ctx - 1 - first, V) at positions first .. n_ctx - 2 of one window (1, n_ctx)."""
    n_ctx = ids.shape[1]
    if form in ("torch", "q8ref"):
        return model(ids[:, :-1], attention="softmax")[0, first:].float()
    state = model.init_state(1, n_ctx, attention="softmax")
    step(ids[:, :first], state, last_only=True)      # the first half: context only
    out = []
    for p in range(first, n_ctx - 1):
        out.append(step(ids[:, p:p + 1], state)[0, -1].float())
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="the GGUF file llama-perplexity ran")
    ap.add_argument("base", help="its --kl-divergence-base file")
    ap.add_argument("--forms", default="torch,q8ref,native")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chunks", type=int, default=None, help="score only the first N windows")
    ap.add_argument("--text", help="the text llama-perplexity read: check gen's tokens against its tokens")
    ap.add_argument("--json")
    a = ap.parse_args()

    base = read_base(a.base)
    n_ctx, n_vocab = base["n_ctx"], base["n_vocab"]
    n_chunk = min(base["n_chunk"], a.chunks or base["n_chunk"])
    first = n_ctx // 2
    llm = engine.load(a.model, attention="softmax", backend="native", threads=a.threads)
    model, tok = llm.model, llm.tokenizer
    if model.config.vocab_size != n_vocab:
        raise SystemExit(f"{a.base} has a vocabulary of {n_vocab}, {a.model} of {model.config.vocab_size}: "
                         "not the same model")
    rec = {"model": a.model, "base": a.base, "n_ctx": n_ctx, "chunks": n_chunk, "targets_per_chunk": n_ctx - 1 - first,
           "threads": torch.get_num_threads()}
    tokens = np.array(base["tokens"][:n_chunk])
    if a.text:
        with open(a.text, encoding="utf-8") as f:
            mine = tok.encode(f.read(), bos=True)
        flat = tokens.reshape(-1)
        same = next((i for i, (x, y) in enumerate(zip(mine, flat)) if x != y), min(len(mine), flat.size))
        rec["tokenizer"] = {"gen_tokens": len(mine), "llama_tokens_checked": int(flat.size), "equal_prefix": int(same)}
    bos = tok.bos_id if getattr(tok, "add_bos", False) else None
    if bos is not None:
        tokens[:, 0] = bos                         # as llama-perplexity: BOS first in every window
    rec["bos_first"] = bos is not None
    targets = tokens[:, first + 1:]
    forms = {}
    for form in a.forms.split(","):
        m = q8_reference(model) if form == "q8ref" else model
        step = make_step(model, "native", threads=a.threads) if form == "native" else None
        sums, t0 = None, time.time()
        with torch.inference_mode():
            for c in range(n_chunk):
                ids = torch.from_numpy(tokens[c:c + 1].astype(np.int64))
                logp = torch.log_softmax(window_logits(form, m, step, ids, first).double(), dim=-1).numpy()
                s = compare(logp, base_log_probs(np.asarray(base["rows"][c]), n_vocab), targets[c])
                sums = s if sums is None else {k: (max(sums[k], v) if k.endswith("_max") else sums[k] + v)
                                               for k, v in s.items()}
        n = sums["count"]
        forms[form] = {"ppl": math.exp(sums["nll"] / n), "ppl_llama": math.exp(sums["nll_base"] / n),
                       "kld_mean": sums["kld"] / n, "kld_max": sums["kld_max"], "same_top": sums["same_top"] / n,
                       "dp_max": sums["dp_max"], "targets": n, "seconds": round(time.time() - t0, 1)}
        if step is not None:
            forms[form]["step_form"] = step.last_form
        print(json.dumps({form: forms[form]}), flush=True)
    rec["forms"] = forms
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
