"""gen's perplexity on llama-perplexity's own token windows, and how far its next-token
distributions sit from llama.cpp's on the same file (issue 33: an outside check of the arithmetic).

    llama-quantize --allow-requantize F.gguf F32.gguf F32       # llama.cpp's own decoding of F's blocks
    llama-perplexity -m F.gguf -f TEXT -c 512 -b 512 --kl-divergence-base F.kld
    llama-perplexity -m F32.gguf -f TEXT -c 512 -b 512 -ctk f32 -ctv f32 --kl-divergence-base F32.kld
    python benchmarks/lcpp_perplexity.py F.gguf F.kld F32.kld --f32 F32.gguf [--text TEXT]
        [--forms torch,native] [--threads 2] [--json out.json]

llama-perplexity (its default mode) cuts the tokens of the whole text into n_chunk windows of n_ctx
tokens, no overlap (the first token of each replaced by BOS where the vocabulary adds one: SmolLM2's
does not), and scores the targets of the second half of each window only: positions n_ctx/2 ..
n_ctx-2 predict tokens n_ctx/2+1 .. n_ctx-1, so n_ctx/2-1 targets per window, each with at least
n_ctx/2 tokens of context. With --kl-divergence-base it also writes those tokens and, per scored
position, its log-probabilities over the whole vocabulary (16-bit, within 16 nats of the top:
tools/perplexity/perplexity.cpp, log_softmax / process_logits). This script reads such files (one
or more runs over the same text) and scores the very same tokens and positions with gen, per form:

  torch   the PyTorch forward of `gen eval`: every block decoded to fp32 (engine.quant.dequantize)
  q8ref   engine.quant.q8_reference: activations rounded to q8 blocks, integer dots per block (the
          native step's arithmetic in PyTorch; slow)
  native  the C step itself, as `gen generate` runs it: the first half of each window prefilled
          (engine.steps.Stepper, default activations), then one decode step per scored position

For each form and each base file: perplexity over the same targets, the mean KL divergence
KL(llama || gen) (over tokens within 16 nats of the top, as llama-perplexity --kl-divergence sums
it), the share of positions whose top token is the same, and the largest |difference| in the
target's probability; llama.cpp's perplexity is read back from each file (its stored target
log-probs: its printed estimate up to the 16-bit rounding), and the later files are compared with
the first the same way (llama.cpp against itself). llama.cpp's default run rounds activations to
q8 blocks (q8_0/q8_1 for the 32-wide kinds, q8_K for K-quants) and keeps an f16 KV cache; its F32
copy with an f32 cache computes in fp32 throughout, as gen's torch form does.
--f32: gen's decoded weights against llama.cpp's F32 copy, tensor by tensor.
--text: checks that gen's tokenizer gives llama.cpp's tokens for that text.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import numpy as np
import torch

import engine
from common import write_json
from engine.quant import QuantEmbedding, QuantLinear, QuantStack, dequantize_model, q8_reference
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
    """Logits (B, n_ctx - 1 - first, V) at positions first .. n_ctx - 2 of windows (B, n_ctx)."""
    n_ctx = ids.shape[1]
    if form in ("torch", "q8ref"):
        return model(ids[:, :-1], attention="softmax")[:, first:].float()
    rows = []
    for row in ids:                                  # the native step: one window at a time, as a user's
        state = model.init_state(1, n_ctx, attention="softmax")
        step(row[None, :first], state, last_only=True)     # the first half: context only
        rows.append(torch.stack([step(row[None, p:p + 1], state)[0, -1].float() for p in range(first, n_ctx - 1)]))
    return torch.stack(rows)


def weights_against(model, f32_path: str) -> dict:
    """gen's decoded weights (every block kind decoded to fp32, engine.quant.dequantize_model) against
    llama.cpp's own decoding of the same file (`llama-quantize --allow-requantize FILE F32`, loaded as
    floats): tensors compared, how many differ, the largest |difference|."""
    floats = engine.load(f32_path, attention="softmax", threads=1).model.state_dict()
    mine = copy.deepcopy(model)
    dequantize_model(mine)
    ours = mine.state_dict()
    if set(ours) != set(floats):
        raise SystemExit(f"{f32_path}: not the same tensors as the model ({sorted(set(ours) ^ set(floats))[:4]} ...)")
    diffs = {k: float((ours[k].float() - floats[k].float()).abs().max()) for k in ours}
    return {"f32": f32_path, "tensors": len(diffs), "differing": sorted(k for k, d in diffs.items() if d),
            "max_abs_diff": max(diffs.values()),
            "block_kinds": sorted({k for m in model.modules() if isinstance(m, (QuantLinear, QuantStack, QuantEmbedding))
                                   for k in m.kind.split("+")})}


def merge(sums: dict | None, s: dict) -> dict:
    return s if sums is None else {k: (max(sums[k], v) if k.endswith("_max") else sums[k] + v) for k, v in s.items()}


def summary(sums: dict) -> dict:
    n = sums["count"]
    return {"ppl_llama": math.exp(sums["nll_base"] / n), "kld_mean": sums["kld"] / n, "kld_max": sums["kld_max"],
            "same_top": sums["same_top"] / n, "dp_max": sums["dp_max"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="the GGUF file gen scores")
    ap.add_argument("base", nargs="+", help="llama-perplexity --kl-divergence-base files of the same text and "
                    "context (e.g. of this file, and of its llama-quantize F32 copy with an f32 KV cache)")
    ap.add_argument("--forms", default="torch,native", help="torch, q8ref, native (comma-separated)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=6, help="windows per PyTorch forward")
    ap.add_argument("--chunks", type=int, default=None, help="score only the first N windows")
    ap.add_argument("--text", help="the text llama-perplexity read: check gen's tokens against its tokens")
    ap.add_argument("--f32", help="llama-quantize --allow-requantize MODEL F32FILE F32: check gen's decoded weights "
                    "against llama.cpp's, tensor by tensor")
    ap.add_argument("--json")
    a = ap.parse_args()

    bases = {os.path.basename(b).removesuffix(".kld"): read_base(b) for b in a.base}
    base = next(iter(bases.values()))
    n_ctx, n_vocab = base["n_ctx"], base["n_vocab"]
    n_chunk = min(base["n_chunk"], a.chunks or base["n_chunk"])
    for name, b in bases.items():
        if (b["n_ctx"], b["n_vocab"]) != (n_ctx, n_vocab) or b["n_chunk"] < n_chunk or \
                not np.array_equal(b["tokens"][:n_chunk], base["tokens"][:n_chunk]):
            raise SystemExit(f"{name}: not the same tokens and windows as {a.base[0]}")
    first = n_ctx // 2
    llm = engine.load(a.model, attention="softmax", backend="native", threads=a.threads)
    model, tok = llm.model, llm.tokenizer
    if model.config.vocab_size != n_vocab:
        raise SystemExit(f"{a.base[0]} has a vocabulary of {n_vocab}, {a.model} of {model.config.vocab_size}: "
                         "not the same model")
    rec = {"model": a.model, "bases": a.base, "n_ctx": n_ctx, "chunks": n_chunk, "targets_per_chunk": n_ctx - 1 - first,
           "threads": torch.get_num_threads()}
    tokens = np.array(base["tokens"][:n_chunk])
    if a.text and tok is not None:
        with open(a.text, encoding="utf-8") as f:
            mine = tok.encode(f.read(), bos=True)
        flat = tokens.reshape(-1)
        same = next((i for i, (x, y) in enumerate(zip(mine, flat)) if x != y), min(len(mine), flat.size))
        rec["tokenizer"] = {"gen_tokens": len(mine), "llama_tokens_checked": int(flat.size), "equal_prefix": int(same)}
    if a.f32:
        rec["weights"] = weights_against(model, a.f32)
        print(json.dumps({"weights": rec["weights"]}), flush=True)
    bos = tok.bos_id if getattr(tok, "add_bos", False) else None
    if bos is not None:
        tokens[:, 0] = bos                         # as llama-perplexity: BOS first in every window
    rec["bos_first"] = bos is not None
    targets = tokens[:, first + 1:]
    names = list(bases)
    for other in names[1:]:     # llama.cpp against itself: how far its own two runs sit apart
        sums = None
        for c in range(n_chunk):
            s = compare(base_log_probs(np.asarray(bases[other]["rows"][c]), n_vocab),
                        base_log_probs(np.asarray(base["rows"][c]), n_vocab), targets[c])
            sums = merge(sums, s)
        rec.setdefault("llama_against", {})[f"{other} vs {names[0]}"] = summary(sums)
    forms = {}
    for form in a.forms.split(","):
        m = q8_reference(model) if form == "q8ref" else model
        step = make_step(model, "native", threads=a.threads) if form == "native" else None
        sums, t0 = {}, time.time()
        with torch.inference_mode():
            for c0 in range(0, n_chunk, a.batch_size):
                ids = torch.from_numpy(tokens[c0:c0 + a.batch_size].astype(np.int64))
                logp = torch.log_softmax(window_logits(form, m, step, ids, first).double(), dim=-1).numpy()
                for i, c in enumerate(range(c0, c0 + len(ids))):
                    for name, b in bases.items():
                        s = compare(logp[i], base_log_probs(np.asarray(b["rows"][c]), n_vocab), targets[c])
                        sums[name] = merge(sums.get(name), s)
        one = next(iter(sums.values()))
        forms[form] = {"ppl": math.exp(one["nll"] / one["count"]), "targets": one["count"],
                       "seconds": round(time.time() - t0, 1), "against": {k: summary(v) for k, v in sums.items()}}
        if step is not None:
            forms[form]["step_form"] = step.last_form
        print(json.dumps({form: forms[form]}), flush=True)
    rec["forms"] = forms
    print(json.dumps(rec))
    if a.json:
        write_json(a.json, rec)


if __name__ == "__main__":
    main()
