"""Log-likelihoods of continuations, each shared context prefilled once.

    scorer = Scorer(model, attention="linear", feature_map=None, batch_tokens=2048)
    scorer.score([(context_ids, continuation_ids), ...]) -> [(logprob, greedy), ...]

What lm-eval asks of a model for its multiple-choice tasks: for each (context, continuation),
the sum of log p(continuation token | everything before it), and whether greedy decoding would
have produced the continuation. A task asks for 2-4 continuations of the same context, so the
requests are grouped by context: a group's context (all of it but its last token) is prefilled
once into a decoding state, the state is copied once per continuation (`State.select_rows`), and
the continuations run as one block: [last context token] + continuation[:-1] per row, whose logits
at position j predict continuation token j. Every attention path implements the same state
protocol, so softmax, linear, hybrid and window layers are all scored this way.

Batching: groups are sorted by context length and packed while their prefill block (left-padded: a
row's real tokens keep the positions they have alone) stays within `batch_tokens` padded tokens; their
continuations, sorted by length, then run in blocks within the same budget, each on copies of its
rows' context states. A continuation block is right-padded with no mask: pads come after every real
token of a row, so causality keeps them out of every score.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.errors import InvalidArgumentError
from engine.generate import left_pad

PAD_WASTE = 1.25     # a block holds at most this many padded tokens per real one
Request = tuple[list[int], list[int]]   # (context ids, continuation ids), both non-empty


@dataclass
class ScoreStats:
    """What scoring ran: `request_tokens` is what scoring every request from scratch would feed
    (context + continuation - 1 each); `fed_tokens` the real tokens fed (each shared context once);
    `model_tokens` the model's work, pads included."""
    requests: int = 0
    request_tokens: int = 0
    fed_tokens: int = 0
    model_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: "ScoreStats") -> None:
        for name in ("requests", "request_tokens", "fed_tokens", "model_tokens", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict:
        rate = self.request_tokens / self.seconds if self.seconds > 0 else 0.0
        return {"requests": self.requests, "request_tokens": self.request_tokens, "fed_tokens": self.fed_tokens,
                "model_tokens": self.model_tokens,
                "seconds": round(self.seconds, 3), "request_tokens_per_s": round(rate, 1)}


class Scorer:
    """Scores requests on `model` (an engine Transformer) along one attention path.

    attention, feature_map: the path and map to run (default: the model config's).
    batch_tokens: padded tokens per model call (a prefill block or a continuation block); the logits of
    a continuation block take batch_tokens x vocabulary x 4 bytes at most (2048 x 49152: 400 MB).
    stats: a ScoreStats to add this scorer's counts to (default: its own).
    """

    def __init__(self, model, attention: str | None = None, feature_map: str | None = None,
                 batch_tokens: int = 2048, stats: ScoreStats | None = None):
        if not isinstance(batch_tokens, int) or batch_tokens < 2:
            raise InvalidArgumentError(f"batch_tokens must be an integer >= 2, got {batch_tokens!r}")
        self.model, self.attention, self.feature_map = model, attention, feature_map
        self.batch_tokens = batch_tokens
        self.stats = stats if stats is not None else ScoreStats()   # counts add up over calls

    def score(self, requests: list[Request], progress=None) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) per request, in order. progress: called with the number of
        requests finished after each batch (a tqdm's `update`)."""
        reqs = [check_request(c, x, self.model.config.vocab_size) for c, x in requests]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (ctx, _) in enumerate(reqs):
            groups.setdefault(tuple(ctx), []).append(i)
        out: list[tuple[float, bool] | None] = [None] * len(reqs)
        t0 = time.perf_counter()
        for batch in self._batches(groups, reqs):
            self._run(batch, groups, reqs, out)
            if progress is not None:
                progress(sum(len(groups[c]) for c in batch))
        self.stats.add(ScoreStats(len(reqs), sum(len(c) + len(x) - 1 for c, x in reqs),
                                  sum(len(c) - 1 for c in groups) + sum(len(x) for _, x in reqs), 0,
                                  time.perf_counter() - t0))
        return out

    # ------------------------------------------------------------------ batching
    def _batches(self, groups, reqs):
        """Lists of contexts (group keys), shortest first, whose left-padded prefill block (groups x
        longest prefix) stays within batch_tokens and PAD_WASTE."""
        batch, prefix, real = [], 0, 0
        for ctx in sorted(groups, key=len):
            p, r = max(prefix, len(ctx) - 1), real + len(ctx) - 1
            padded = (len(batch) + 1) * p
            if batch and (padded > self.batch_tokens or padded > PAD_WASTE * r):
                yield batch
                batch, p, r = [], len(ctx) - 1, len(ctx) - 1
            batch.append(ctx)
            prefix, real = p, r
        if batch:
            yield batch

    @torch.inference_mode()
    def _run(self, batch, groups, reqs, out) -> None:
        """Prefill the batch's contexts once, then run their continuations in blocks of similar lengths
        (rows x longest continuation within batch_tokens and PAD_WASTE), each on copies of its rows'
        context states."""
        model, dev = self.model, self.model.device
        prefixes = [list(ctx[:-1]) for ctx in batch]
        P = max(len(p) for p in prefixes)
        state = None
        if P:
            state = model.init_state(batch=len(batch), max_len=P, attention=self.attention,
                                     feature_map=self.feature_map, device=dev)
            # a context of one token has an empty prefix: an all-pad row (pads attend only to themselves)
            tokens, valid = left_pad([p or [0] for p in prefixes], dev)
            if any(not p for p in prefixes):
                valid = tokens.new_ones(tokens.shape, dtype=torch.bool) if valid is None else valid.clone()
                for g, p in enumerate(prefixes):
                    if not p:
                        valid[g] = False
            model.step(tokens, state, valid=valid, last_only=True)
            self.stats.model_tokens += tokens.numel()
        group_of = {i: g for g, ctx in enumerate(batch) for i in groups[ctx]}
        block, real = [], 0
        for i in sorted(group_of, key=lambda i: len(reqs[i][1])):
            n = len(reqs[i][1])
            padded = (len(block) + 1) * n
            if block and (padded > self.batch_tokens or padded > PAD_WASTE * (real + n)):
                self._block(block, state, group_of, P, reqs, out)
                block, real = [], 0
            block.append(i)
            real += n
        self._block(block, state, group_of, P, reqs, out)

    def _block(self, rows, state, group_of, P, reqs, out) -> None:
        """Rows' continuations as one right-padded block: [last context token] + continuation[:-1]."""
        model, dev = self.model, self.model.device
        T = max(len(reqs[i][1]) for i in rows)
        if state is not None:
            state = state.select_rows([group_of[i] for i in rows], max_len=P + T)
        else:
            state = model.init_state(batch=len(rows), max_len=T, attention=self.attention,
                                     feature_map=self.feature_map, device=dev)
        block = torch.zeros(len(rows), T, dtype=torch.long)
        for r, i in enumerate(rows):
            ctx, cont = reqs[i]
            fed = [ctx[-1]] + cont[:-1]
            block[r, :len(fed)] = torch.tensor(fed)
        logits = model.step(block.to(dev), state)                       # (R, T, V)
        self.stats.model_tokens += block.numel()
        for r, i in enumerate(rows):
            cont = torch.tensor(reqs[i][1], device=dev)
            lg = logits[r, :len(cont)].float()                           # (n, V)
            logprobs = lg.log_softmax(-1).gather(1, cont[:, None]).squeeze(1)
            out[i] = (float(logprobs.sum()), bool((lg.argmax(-1) == cont).all()))


def check_request(ctx, cont, vocab_size: int) -> Request:
    ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
    if not ctx or not cont:
        raise InvalidArgumentError("a scoring request needs at least one context token and one continuation token "
                                   "(an empty context: start it with the BOS or EOS id)")
    bad = [t for t in ctx + cont if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ctx, cont
