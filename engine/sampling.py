"""Choosing the next token from logits: penalty, temperature, top-k, top-p, min-p, a seeded draw.

Every filter is a pure function of a (B, V) logits tensor that returns a new (B, V) tensor
with the removed tokens set to -inf. The `Sampler` owns one `torch.Generator` per sequence,
so a request's draws depend on its seed alone: other code drawing from torch's global RNG
in between, or other requests sampling on the same model, cannot change them. Row b of a
batch draws from its own generator seeded with the request's seed, so a batched request
samples exactly what the same prompt alone would (given equal logits).

Order (that of Hugging Face and llama.cpp): logit bias and repetition penalty on the raw
logits -> presence/frequency penalties -> temperature -> top-k -> top-p -> min-p -> draw.
Temperature 0 is greedy: argmax of the biased, penalized logits, no division at all.

OpenAI's settings: `logit_bias` adds a bias in [-100, 100] to a token's logit (-100 bans it, +100
all but forces it); `presence_penalty` p and `frequency_penalty` f in [-2, 2] lower a token's logit
by p if it was generated at least once and by f times the number of times it was generated
(logit -= p * (count > 0) + f * count, OpenAI's formula; generated tokens only, not the prompt).

Repetition penalty (CTRL, Keskar et al. 2019), sign-aware: a seen token's logit is divided
by the penalty when positive and multiplied by it when negative, so it always moves down and
the token's odds against every unseen token drop, whatever its sign (dividing a negative
logit would raise it: transformers #2302). It is applied once per distinct token however
often the token occurs. Prompt tokens count as seen, as in transformers and llama.cpp
(left pads do not). A logit of exactly 0 is left at 0 by this rule.

Extreme settings never sample garbage: top-p always keeps the most likely token (a top_p that
underflows in float32, 1e-46, is top-1), a penalty outside float32's normal range is refused, and
a row whose filtered logits hold a NaN, a +inf or nothing above -inf (softmax would give NaN
probabilities) takes the greedy token instead (`greedy_ids`), in both samplers.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from engine.errors import InvalidArgumentError

GREEDY_BELOW = 1e-6   # temperatures below this are greedy: softmax(l / T) is one-hot in fp32 anyway
FP32 = torch.finfo(torch.float32)   # the sampler's arithmetic: a penalty must be a normal number in it

# A chat's sampling where the model names none: llama.cpp's defaults (common_params_sampling in
# common/common.h): without truncation a 0.8 temperature draws from the long tail and derails a
# small chat model within a few turns.
CHAT_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off; penalty 1 =
    off; presence/frequency penalties 0 = off; logit_bias: (token id, bias) pairs, () = none;
    seed None = a fresh nondeterministic seed (from the OS, not from torch's global RNG)."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()

    def __post_init__(self):
        def bad(msg):
            raise InvalidArgumentError(msg)
        if not _finite(self.temperature) or self.temperature < 0:
            t = self.temperature
            what = "a finite number >= 0" if t == math.inf else ">= 0"
            bad(f"temperature must be {what} (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0 (1 = off, > 1 discourages repeats), got {self.repetition_penalty!r}")
        if not FP32.tiny <= self.repetition_penalty <= FP32.max:
            bad(f"repetition_penalty must be within float32's range [{FP32.tiny:.3g}, {FP32.max:.3g}] "
                f"(1 = off), got {self.repetition_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 63):
            bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            if not _finite(x) or not -2 <= x <= 2:
                bad(f"{name} must be in [-2, 2] (0 = off), got {x!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = [(i, b) for i, b in bias]
        except (TypeError, ValueError):
            bad(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        for i, b in pairs:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                bad(f"logit_bias keys must be token ids (integers >= 0), got {i!r}")
            if not _finite(b) or not -100 <= b <= 100:
                bad(f"logit_bias values must be in [-100, 100], got {b!r} for token {i}")
        if len({i for i, _ in pairs}) != len(pairs):
            bad("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((i, float(b)) for i, b in pairs)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def counts_tokens(self) -> bool:
        """The presence or frequency penalty is on: a sampler counts the tokens it generates."""
        return bool(self.presence_penalty or self.frequency_penalty)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def chat_sampling(model_sampling: dict | None = None) -> dict:
    """A chat's default settings: CHAT_DEFAULTS, overridden by each key the model's own generation
    config names (models.generation_config), as llama.cpp layers a GGUF's general.sampling.* over
    its defaults. Checked: a bad value in the model's file is an InvalidArgumentError naming it."""
    out = {**CHAT_DEFAULTS, **(model_sampling or {})}
    try:
        SamplingParams(**out)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"the model's generation config: {e}") from None
    return out


def describe_sampling(settings: dict) -> str:
    """"temperature 0.8, top-k 40, top-p 0.95, min-p 0.05": the settings that are on, for a banner."""
    if settings.get("temperature", 1.0) < GREEDY_BELOW:
        return "greedy (temperature 0)"
    off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    names = {"temperature": "temperature", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p",
             "repetition_penalty": "repetition penalty"}
    return ", ".join(f"{names[k]} {settings[k]:g}" for k in names if k in settings and settings[k] != off.get(k))


# ---------------------------------------------------------------------- pure functions of logits
def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (B, V) float; seen (B, V) bool, True at tokens already in the sequence."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_logit_bias(logits: torch.Tensor, bias: tuple) -> torch.Tensor:
    """logits (B, V) float; bias: (token id, value) pairs added to every row."""
    if not bias:
        return logits
    ids = torch.tensor([i for i, _ in bias], device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(logits.shape[0], -1))


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """logits (B, V) float; counts (B, V): how often each token was generated. OpenAI's penalties:
    logit -= presence * (count > 0) + frequency * count."""
    if not presence and not frequency:
        return logits
    counts = counts.to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k largest logits per row (ties broken by index); k = 0 or >= V: all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (nucleus)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs             # mass of the strictly more likely tokens
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False                        # the most likely token is always kept (p may be 0 in fp32)
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens whose probability is below p times the most likely token's."""
    if p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), float("-inf"))


def filtered_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, V) -> the fp32 logits the draw samples from: biased, penalized, scaled, filtered.
    seen (B, V) bool: tokens in the sequence (repetition penalty); counts (B, V): tokens generated
    (presence and frequency penalties)."""
    x = apply_logit_bias(logits.float(), params.logit_bias)
    if seen is not None:
        x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    if counts is not None:
        x = apply_presence_frequency(x, counts, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return x
    x = x / params.temperature
    x = top_k_filter(x, params.top_k)
    x = top_p_filter(x, params.top_p)
    return min_p_filter(x, params.min_p)


def unsampleable(x: torch.Tensor) -> torch.Tensor:
    """x (B, V) filtered logits -> (B,) bool: the rows softmax cannot make a distribution of (a NaN,
    a +inf, or no token above -inf: NaN probabilities, which a draw would turn into garbage)."""
    return torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | ~(x > float("-inf")).any(-1)


def greedy_ids(x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, V) -> (B,) argmax ids, NaN counted as -inf (torch's argmax picks a NaN); a row with no
    token above -inf takes the argmax of `logits` (B, V), the unfiltered row, when given. One argmax
    and a gather of B values, read here, when no row is degenerate (the server's greedy rows, every step)."""
    ids = x.argmax(-1)
    chosen = x.gather(-1, ids[:, None])[:, 0]
    if any(v != v or v == float("-inf") for v in chosen.tolist()):   # (v != v: NaN)
        neg = float("-inf")
        bad = torch.isnan(chosen) | (chosen == neg)
        y = torch.where(torch.isnan(x), neg, x)
        ids = torch.where(bad, y.argmax(-1), ids)
        if logits is not None:
            empty = ~(y > neg).any(-1)
            raw = logits.float()
            ids = torch.where(empty, torch.where(torch.isnan(raw), neg, raw).argmax(-1), ids)
    return ids


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """InvalidArgumentError when logit_bias names a token id outside the vocabulary."""
    outside = [i for i, _ in params.logit_bias if i >= vocab_size]
    if outside:
        raise InvalidArgumentError(f"logit_bias: token id {outside[0]} is outside the vocabulary (0..{vocab_size - 1})")


# ---------------------------------------------------------------------- the one sampler
# Every caller draws the same way (the API, `gen`, chat and the server's batches): a row draws ONE
# uniform number from its own torch.Generator, seeded with the request's seed, and inverts its own
# CDF (fp64 cumulative sum, `searchsorted`); rows that share settings are filtered as one (k, V)
# block. So a request's tokens depend on its seed and its logits only, alone or in any batch, in the
# API or on the server. (torch.multinomial, the draw before, spent V exponential numbers a token:
# ~1 ms a row at V = 49152.) A row's uniforms come UNIFORM_BLOCK at a time (CPU generators fill a
# tensor serially: the same numbers, in the same order, as one draw per token; a test holds this).
# The generator is a CPU one whatever the model's device: the uniforms are read on the CPU anyway
# (`tolist`), a CUDA generator cannot fill a CPU tensor, and so a seed draws the same numbers on
# every device.

UNIFORM_BLOCK = 64   # uniforms a sampled row draws from its generator at a time


class RowSampler:
    """One request's sampling state: its settings, its generator, the tokens it has seen (for the
    repetition penalty: the prompt and every token drawn) and how often it drew each (for the
    presence and frequency penalties)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device="cpu"):
        self.params = params
        self.key = (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty,
                    params.presence_penalty, params.frequency_penalty, params.logit_bias)
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator()   # on the CPU: see UNIFORM_BLOCK's note
            self.generator.manual_seed(self.seed)
        self._uniforms: list[float] = []
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)   # (1, V)
            self.seen[0, torch.as_tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.counts = (torch.zeros(1, vocab_size, dtype=torch.int32, device=device)   # (1, V)
                       if params.counts_tokens else None)

    def observe(self, token: int) -> None:
        if self.seen is not None:
            self.seen[0, token] = True
        if self.counts is not None:
            self.counts[0, token] += 1

    def uniform(self) -> float:
        """The row's next uniform number in [0, 1) (fp64), as torch.rand(1, generator=...) would give it."""
        if not self._uniforms:
            block = torch.rand(UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64).tolist()
            self._uniforms = block[::-1]   # popped from the end: in draw order
        return self._uniforms.pop()


def sample_rows(samplers: list["RowSampler"], logits: torch.Tensor) -> list[int]:
    """logits (B, V), row b for samplers[b] -> B token ids; each sampler observes its token."""
    B, V = logits.shape
    groups: dict[tuple, list[int]] = {}
    for b, s in enumerate(samplers):
        groups.setdefault(s.key, []).append(b)
    out = [0] * B
    for rows in groups.values():
        first = samplers[rows[0]]
        raw = logits if len(rows) == B else logits[rows]                                # (k, V)
        seen = torch.cat([samplers[b].seen for b in rows]) if first.seen is not None else None
        counts = torch.cat([samplers[b].counts for b in rows]) if first.counts is not None else None
        x = filtered_logits(raw, first.params, seen, counts)
        if first.params.greedy:
            tokens = greedy_ids(x, raw).tolist()
        else:
            cdf = x.softmax(-1).double().cumsum(-1)                                     # (k, V)
            # u < 1, so u * total < total: the first index whose CDF passes the target is a token of
            # nonzero weight; the target is kept below total against rounding
            totals = cdf[:, -1].tolist()
            targets = [min(samplers[b].uniform() * total, math.nextafter(total, 0.0))
                       for b, total in zip(rows, totals)]
            target = torch.tensor(targets, dtype=torch.float64, device=cdf.device)[:, None]   # (k, 1)
            tokens = [min(t, V - 1) for t in torch.searchsorted(cdf, target, right=True)[:, 0].tolist()]
            if not all(total > 0 for total in totals):   # NaN probabilities (a NaN, +inf or no token left in
                # the row: the CDF would land on the last id): the greedy token
                fallback = greedy_ids(x, raw).tolist()
                tokens = [t if total > 0 else f for t, f, total in zip(tokens, fallback, totals)]
        for b, t in zip(rows, tokens):
            out[b] = t
            samplers[b].observe(t)
    return out


class Sampler:
    """The rows of one batch (`gen`, the API): a RowSampler each, all with the same settings and, given a
    seed, that seed (a batched request samples exactly what the same prompt alone would, given equal
    logits); without one, a seed of its own each (`seeds`).

    batch: number of sequences; vocab_size: V. Call `observe(prompt ids, valid)` once with the
    prompt, then `sample(logits)` each step (it observes the token it returns).
    """

    def __init__(self, params: SamplingParams, batch: int, vocab_size: int, device="cpu"):
        check_vocab(params, vocab_size)
        self.params = params
        # no seed: each row draws its own from the OS (four copies of one prompt are four samples, as
        # num_return_sequences gives); a seed: every row that seed (a row samples what it would alone)
        self.rows = [RowSampler(params, [], vocab_size, device) for _ in range(batch)]

    @property
    def seeds(self) -> list[int]:
        """Each row's seed (drawn from the OS where none was given)."""
        return [row.seed for row in self.rows]

    @property
    def seed(self) -> int | None:
        return self.rows[0].seed if self.rows else self.params.seed

    def observe(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Prompt tokens (B, T) int64; valid (B, T) bool, False at pads (not counted as seen)."""
        if self.rows and self.rows[0].seen is not None:
            for b, row in enumerate(self.rows):
                ids = tokens[b] if valid is None else tokens[b][valid[b]]
                row.seen[0, ids] = True

    @property
    def seen(self) -> torch.Tensor | None:
        """(B, V) bool: the tokens each row has held (prompt and sampled), with a repetition penalty."""
        return torch.cat([row.seen for row in self.rows]) if self.rows and self.rows[0].seen is not None else None

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) -> next tokens (B,) int64."""
        return torch.tensor(sample_rows(self.rows, logits), dtype=torch.long, device=logits.device)
