"""Passkey retrieval: a 5-digit number stated once in filler text, asked for at the end, greedy.

    p = make_prompt(tokenizer, length=1024, depth=0.5, key="48213")   # p.ids, p.text, p.needle_start
    report = run_passkey(llm, lengths=[512, 1024], depths=[0.1, 0.5, 0.9], trials=20, seed=0)

The prompt (Mohtashami and Jaggi 2023's form, as long-context papers use it):

    <intro> <filler ...> The pass key is 48213. Remember it. <filler ...> What is the pass key? The pass key is

The filler is five short sentences repeated; `depth` is the share of the filler before the needle
(0: right after the intro, 1: right before the question), and the filler is cut at whole sentences so
that the prompt, BOS included, is at most `length` tokens and within one sentence of it. A trial is
right when the first number the model writes (greedy, up to 10 tokens) is the key.

Trials: `trials` per length, spread round-robin over the depths, each with its own random key.
Trials of one (length, depth) share every token before their keys; all of them, sorted by that
shared prefix, share one running prefill of the filler (each prefix extends the one before, as the
filler is the same text), so every filler token is prefilled once per prefix and the trials copy the
state (`State.select_rows`) and run only their own tail. This holds on every attention path.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch

from engine.api import make_config
from engine.errors import InvalidArgumentError
from engine.generate import Generation

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it."
QUESTION = "What is the pass key? The pass key is"
MAX_NEW_TOKENS = 10
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
MAX_LENGTH = 1 << 20   # tokens: past this a prompt is a typo, not a test (its filler alone would take gigabytes)


@dataclass
class PasskeyPrompt:
    ids: list[int]           # BOS (where the tokenizer adds one) + the prompt's tokens
    text: str
    key: str
    depth: float             # the share of the filler before the needle
    needle_start: int        # index in `ids` of the needle's first token
    filler_sentences: int    # before + after the needle


def filler(start: int, n: int) -> list[str]:
    return [FILLER[i % len(FILLER)] for i in range(start, start + n)]


def prompt_text(before: int, after: int, key: str) -> tuple[str, str]:
    """(the prompt, its text up to the needle)."""
    head = " ".join([INTRO] + filler(0, before))
    return " ".join([head, NEEDLE.format(key=key)] + filler(before, after) + [QUESTION]), head


def make_prompt(tokenizer, length: int, depth: float, key: str) -> PasskeyPrompt:
    """The longest prompt of at most `length` tokens (BOS included) with the needle at `depth`."""
    if not 0.0 <= depth <= 1.0:
        raise InvalidArgumentError(f"passkey depth {depth} is outside 0..1 (the share of the filler before the key)")

    def build(n: int):
        before = round(depth * n)
        text, head = prompt_text(before, n - before, key)
        return tokenizer.encode(text, bos=True), text, head

    ids, _, _ = build(0)
    if len(ids) > length:
        raise InvalidArgumentError(f"passkey length {length} is too short: the intro, the key and the question alone "
                                   f"take {len(ids)} tokens")
    per = len(tokenizer.encode(" ".join(FILLER))) / len(FILLER)
    n = max(0, int((length - len(ids)) / per))
    while n > 0 and len(build(n)[0]) > length:          # the estimate, then a sentence at a time
        n -= 1
    while len(build(n + 1)[0]) <= length:
        n += 1
    ids, text, head = build(n)
    return PasskeyPrompt(ids, text, key, depth, len(tokenizer.encode(head, bos=True)), n)


def common_prefix(rows: list[list[int]]) -> int:
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows[1:]):
            return i
    return n


def check_lengths(lengths: list[int]) -> None:
    """At least one length, none above MAX_LENGTH (before any prompt is built): one line."""
    if not lengths:
        raise InvalidArgumentError("give at least one passkey length")
    too_long = [n for n in lengths if n > MAX_LENGTH]
    if too_long:
        raise InvalidArgumentError(f"passkey length {too_long[0]} is more than {MAX_LENGTH:,} tokens; give lengths "
                                   f"up to the context you mean to test")


def passkey_prompts(tokenizer, lengths: list[int], depths=DEPTHS, trials: int = 20,
                    seed: int = 0) -> dict[tuple[int, float], list[PasskeyPrompt]]:
    """Every trial's prompt, by (length, depth); the settings checked (one line each) before any model
    work: a caller may build them first to refuse a run before it scores anything."""
    if tokenizer is None:
        raise InvalidArgumentError("passkey needs a tokenizer to write its prompts; this model ships none")
    if not isinstance(trials, int) or trials < 1:
        raise InvalidArgumentError(f"--trials must be at least 1, got {trials!r}")
    depths = [float(d) for d in depths]
    if not depths:
        raise InvalidArgumentError("give at least one passkey depth")
    check_lengths(lengths)
    rng = random.Random(seed)
    points: dict[tuple[int, float], list[PasskeyPrompt]] = {}
    for length in lengths:
        for t in range(trials):
            depth = depths[t % len(depths)]
            points.setdefault((length, depth), []).append(
                make_prompt(tokenizer, length, depth, str(rng.randint(10000, 99999))))
    return points


def run_passkey(llm, lengths: list[int], depths=DEPTHS, trials: int = 20, seed: int = 0,
                batch_tokens: int = 8192, progress=None, points=None) -> dict:
    """Accuracy per length and per (length, depth) of `llm` (an engine.api.LLM) at greedy decoding.

    batch_tokens: trials run together while rows x prompt length stays within it (a softmax row's KV
    cache is one prompt long; SmolLM2's: 46 KB a token). progress: called with the number of trials
    finished. points: passkey_prompts(llm.tokenizer, lengths, depths, trials, seed), if built already."""
    if points is None:
        points = passkey_prompts(llm.tokenizer, lengths, depths, trials, seed)
    depths = [float(d) for d in depths]
    model, t0 = llm.model, time.perf_counter()
    capacity = max(len(p.ids) for ps in points.values() for p in ps) + MAX_NEW_TOKENS
    # what a point's trials share, up to the needle (beyond it they differ by the key): the filler before
    shared = {k: min(common_prefix([p.ids for p in ps]), min(p.needle_start for p in ps)) for k, ps in points.items()}
    base, base_ids, fed, whole = None, [], 0, 0
    answers: dict[tuple[int, float], list[tuple[str, str]]] = {}
    with torch.inference_mode():
        for point in sorted(points, key=lambda k: shared[k]):
            prompts, P = points[point], shared[point]
            ids = prompts[0].ids[:P]
            if base is None or ids[:len(base_ids)] != base_ids:
                base = model.init_state(batch=1, max_len=capacity, attention=llm.attention,
                                        feature_map=llm.feature_map, device=model.device)
                base_ids = []
            if len(ids) > len(base_ids):
                llm.step(torch.tensor([ids[len(base_ids):]], device=model.device), base, last_only=True)
                fed += len(ids) - len(base_ids)
                base_ids = ids
            longest = max(len(p.ids) for p in prompts)
            rows = max(1, batch_tokens // longest)
            for b in range(0, len(prompts), rows):
                chunk = prompts[b:b + rows]
                state = base.select_rows([0] * len(chunk), max_len=longest + MAX_NEW_TOKENS)
                gen = Generation(model, [p.ids[P:] for p in chunk], make_config(max_new_tokens=MAX_NEW_TOKENS,
                                 temperature=0.0), llm.tokenizer, attention=llm.attention,
                                 feature_map=llm.feature_map, step=llm.step, state=state)
                for p, result in zip(chunk, gen.run()):
                    answers.setdefault(point, []).append((p.key, result.text))
                fed += sum(len(p.ids) - P for p in chunk)
                whole += sum(len(p.ids) for p in chunk)
                if progress is not None:
                    progress(len(chunk))
    return summarize(points, answers, lengths, depths, seconds=time.perf_counter() - t0, fed=fed, whole=whole)


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def summarize(points, answers, lengths, depths, seconds: float, fed: int, whole: int) -> dict:
    per_length, per_depth, samples = {}, {}, []
    for (length, depth), got in sorted(answers.items()):
        right = sum(first_number(text) == key for key, text in got)
        per_depth.setdefault(str(length), {})[f"{depth:g}"] = {"correct": right, "trials": len(got)}
        cell = per_length.setdefault(str(length), {"correct": 0, "trials": 0,
                                                   "tokens": max(len(p.ids) for p in points[(length, depth)])})
        cell["correct"] += right
        cell["trials"] += len(got)
        cell["tokens"] = max(cell["tokens"], max(len(p.ids) for p in points[(length, depth)]))
        samples += [{"length": length, "depth": depth, "key": key, "answer": text} for key, text in got]
    for cell in per_length.values():
        cell["accuracy"] = cell["correct"] / cell["trials"]
    return {"lengths": per_length, "depths": per_depth, "trials": samples, "seconds": round(seconds, 2),
            "prompt_tokens": whole, "prefilled_tokens": fed}
