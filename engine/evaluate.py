"""Perplexity, nats/token and bits per byte over the documents of a corpus file.

Each document is scored as BOS + text + EOS: every token after BOS is predicted, the EOS
included; its bytes are the UTF-8 length of the text plus one for the EOS. A document
longer than the context is scored in overlapping windows (stride = half the context), each
target scored once, with as much left context as the window gives; never truncated.
Both attention paths are scored with the same windows, so their numbers compare.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.errors import InvalidArgumentError
from models.corpus import read_documents


@dataclass
class EvalResult:
    attention: str
    perplexity: float
    nats_per_token: float
    bits_per_byte: float
    tokens: int
    bytes: int
    documents: int
    context: int

    def to_dict(self) -> dict:
        return asdict(self)


def windows(ids: list[int], context: int) -> list[tuple[list[int], int]]:
    """Split one document into (window ids, index of the first position whose target counts)."""
    n = len(ids)
    if n <= context:
        return [(ids, 0)]
    out, start, scored = [], 0, 1          # scored: index of the next target not yet scored
    stride = max(1, context // 2)
    while True:
        end = min(start + context, n)
        out.append((ids[start:end], scored - 1 - start))
        scored = end
        if end == n:
            return out
        start += stride


@torch.no_grad()
def evaluate(model, tokenizer, docs: list[str], attention: str | None = None, feature_map: str | None = None,
             context: int | None = None, batch_size: int = 8, progress: bool = False) -> EvalResult:
    attention = attention or model.config.attention
    context = context or model.config.max_position_embeddings
    items, n_bytes = [], 0
    for doc in docs:
        items += windows(tokenizer.encode(doc, bos=True, eos=True), context)
        n_bytes += len(doc.encode("utf-8")) + 1
    items.sort(key=lambda it: len(it[0]))
    nll, n_tok = 0.0, 0
    bar = None
    if progress:
        bar = tqdm(total=len(items), desc=f"eval {attention}", unit="win", leave=False)
    dev = model.device
    for b in range(0, len(items), batch_size):
        chunk = items[b:b + batch_size]
        T = max(len(ids) for ids, _ in chunk)
        tokens = torch.zeros(len(chunk), T, dtype=torch.long)
        weight = torch.zeros(len(chunk), T - 1)
        for r, (ids, first) in enumerate(chunk):
            tokens[r, :len(ids)] = torch.tensor(ids)
            weight[r, first:len(ids) - 1] = 1.0      # right padding: pads sit after every scored target
        tokens, weight = tokens.to(dev), weight.to(dev)
        logits = model(tokens[:, :-1], attention=attention, feature_map=feature_map)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        nll += float((loss * weight.flatten()).sum())
        n_tok += int(weight.sum())
        if bar:
            bar.update(len(chunk))
    if bar:
        bar.close()
    nats = nll / max(n_tok, 1)
    return EvalResult(attention=attention, perplexity=math.exp(nats), nats_per_token=nats,
                      bits_per_byte=nll / math.log(2) / max(n_bytes, 1), tokens=n_tok, bytes=n_bytes,
                      documents=len(docs), context=context)


def evaluate_file(model, tokenizer, path, attention: str | None = None, feature_map: str | None = None,
                  context: int | None = None, batch_size: int = 8, progress: bool = False,
                  max_docs: int | None = None) -> EvalResult:
    """Score every document of a corpus file (documents separated by `<|endoftext|>` lines), or the
    first `max_docs` of them."""
    if tokenizer is None:
        raise InvalidArgumentError("this checkpoint ships no tokenizer.model; evaluation needs one to "
                                   "encode the text")
    if context is not None and context < 2:
        raise InvalidArgumentError(f"context must be at least 2 tokens, got {context}")
    if max_docs is not None and max_docs < 1:
        raise InvalidArgumentError(f"max_docs must be at least 1, got {max_docs}")
    docs = read_documents(path)
    return evaluate(model, tokenizer, docs[:max_docs] if max_docs else docs, attention=attention,
                    feature_map=feature_map, context=context, batch_size=batch_size, progress=progress)
