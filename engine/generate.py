"""The generation loop: prefill, then one `model.step` per token, for one prompt or a batch.

The loop never asks which attention path or step form runs: it allocates a state with
`model.init_state(...)`, prefills the prompts as one block (logits for the last position
only), then feeds back one token per sequence per step. Prompts of different lengths are
left-padded and carry a `valid` mask, so every sequence's real tokens sit at the positions
they would have alone: greedy batch output equals each prompt generated alone.

A `Generation` is an iterator of `TokenEvent`s (one per sequence per step, in row order).
It owns the state and frees it as soon as the sequences finish, the consumer calls
`close()` (or leaves a `with` block), or the iterator is dropped. An exception raised by the
model or the sampler reaches the consumer through `next()`, and the state is freed then too.
"""
from __future__ import annotations

import operator
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.errors import InvalidArgumentError
from engine.sampling import Sampler, SamplingParams
from engine.sequence import Sequence, eos_set, flush  # noqa: F401 -- eos_set, flush: their old home
from engine.stopping import check_stop_strings
from models.pages import trim_heap

PROGRESS_BLOCK = 4096   # a longer prompt reports its prefill (Generation.on_prefill) about this often


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and when to stop (the sampler's settings are in `sampling`).

    eos_ids: the EOS set; None means the model config's ids together with the tokenizer's.
    ignore_eos: never stop on EOS (fixed-length runs for benchmarks).
    max_context: real tokens one sequence may hold in the softmax KV cache, prompt included
    (default: the config's max_position_embeddings). The linear state has no limit.
    """
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    max_context: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", check_stop_strings(self.stop))
        n = self.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgumentError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        c = self.max_context
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise InvalidArgumentError(f"max_context must be an integer >= 1, got {c!r}")
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", token_ids(self.eos_ids, "eos_ids"))
        if not isinstance(self.ignore_eos, bool):   # "no" would be true
            raise InvalidArgumentError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")


def token_ids(ids, name: str) -> tuple[int, ...]:
    """A list (tuple, set, range) of token ids, integers >= 0, as a tuple; else one line naming `name`."""
    try:
        if isinstance(ids, (str, bytes, dict)) or any(isinstance(i, bool) for i in ids):
            raise TypeError
        out = tuple(operator.index(i) for i in ids)
    except TypeError:
        out = None
    if out is None or any(i < 0 for i in out):
        raise InvalidArgumentError(f"{name} must be a list of token ids (integers >= 0), got {ids!r:.60}")
    return out


@dataclass
class Stats:
    prompt_tokens: int
    new_tokens: int
    prefill_s: float                # the prompt block's step (the whole batch's)
    time_to_first_token_s: float    # from the call to the first sampled token
    decode_s: float                 # from the first token to this sequence's last
    decode_tokens_per_s: float      # (new_tokens - 1) / decode_s; 0 with fewer than 2 tokens (no decode step)
    state_bytes: int                # the decoding state's tensors (the whole batch's)
    attention: str
    batch: int
    seed: int                       # this sequence's sampler seed (drawn from the OS when none was given)
    step_form: str | None = None    # the form that ran the last decode step (engine.steps); None: none ran

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Result:
    text: str                       # the continuation ("" without a tokenizer), cut before a stop string
    ids: list[int]                  # every sampled id, an EOS or the tokens of a stop string included
    finish_reason: str | None       # "stop", "length", "context"; None while unfinished
    stats: Stats
    stop_reason: int | str | None = None   # with finish_reason "stop": the EOS id sampled, or the stop string


@dataclass
class TokenEvent:
    row: int                        # which prompt of the batch
    id: int                         # the sampled token
    text: str                       # text this token releases (may be "": held back, or EOS)
    finish_reason: str | None       # set on the sequence's last token


class Closing:
    """`with obj:` calls obj.close() at the end (Generation, ChatReply, api.TextStream)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Generation(Closing):
    """Generate from `prompts` (lists of token ids) with `model`; iterate for `TokenEvent`s.

    tokenizer: needed for text and stop strings; without one, every event's text is "".
    state: continue a state the caller owns (a chat session) instead of allocating one: `prompts`
    are then only the tokens to add to it; its capacity, not max_context, bounds the context.
    After iteration, `results[b]` holds each sequence's `Result`.
    """

    def __init__(self, model, prompts: list[list[int]], config: GenerationConfig, tokenizer=None,
                 attention: str | None = None, feature_map: str | None = None, step=None, state=None, spec=None,
                 seen: list[list[int]] | None = None):
        """state: a state already holding tokens (a chat session's) to continue; seen: per sequence, the
        tokens that state holds, which a repetition penalty counts as the prompt's (as a whole prompt's)."""
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.seen = seen
        self.step = step or model.step   # an engine.steps.Stepper picks the step form; default: the module path
        self.spec = model.run_spec(attention, feature_map, spec)   # the run (engine.runspec.RunSpec)
        self.attention = self.spec.attention
        self.feature_map = feature_map
        self.prompts = check_prompts(prompts, model.config.vocab_size)
        outside = [i for i in config.eos_ids or () if i >= model.config.vocab_size]
        if outside:   # it could never be sampled: the run would not stop where the caller meant
            raise InvalidArgumentError(f"eos_ids: token id {outside[0]} is outside the vocabulary "
                                       f"(0..{model.config.vocab_size - 1})")
        if config.stop and tokenizer is None:
            raise InvalidArgumentError("stop strings need a tokenizer, and this model ships none; "
                                       "drop --stop or use a checkpoint with tokenizer.model")
        B, N = len(self.prompts), config.max_new_tokens
        P, shortest = max(len(p) for p in self.prompts), min(len(p) for p in self.prompts)
        context = config.max_context or model.config.max_position_embeddings
        # The state is allocated here, once. A state with a capacity (the KV cache) gets room for
        # each sequence's last fed-back token, pads included; the linear state ignores max_len. A
        # prompt longer than the context is refused below: it gets a one-slot cache, not one of its size.
        if state is None:
            max_len = 1 if P > context else max(P, min(P - shortest + context, P + N - 1))
            self.state = allocate(model, batch=B, max_len=max_len, spec=self.spec, device=model.device)
            self.offset = 0      # tokens already in the state before the prompt
            self._owns_state = True
        else:
            self.state, self.offset = state, state.slots
            if state.batch_size != B:
                raise InvalidArgumentError(f"the state holds {state.batch_size} sequences, not {B}")
            context = state.max_len
        self.context = context if self.state.max_len is not None else None
        if self.context is not None and self.offset + P > self.context:
            if state is not None:
                raise InvalidArgumentError(
                    f"the conversation would hold {self.offset + P} tokens but the context holds {self.context}; "
                    f"start a new one (reset), raise max_context, or use linear attention (no limit)")
            self.state = None
            raise InvalidArgumentError(
                f"the prompt has {P} tokens but the context holds {self.context} (max_context); "
                f"shorten the prompt, raise max_context, or use linear attention (no limit)")
        self.state_bytes = self.state.nbytes
        self.eos = frozenset(() if config.ignore_eos else eos_set(model.config, tokenizer, config.eos_ids))
        # each sequence's finish rules (engine.sequence): EOS, stop strings, length, context
        room = [None if self.context is None else self.context - self.offset - len(p) for p in self.prompts]
        self.sequences = [Sequence(tokenizer, config.stop, self.eos, N, r) for r in room]
        self.ids: list[list[int]] = [seq.ids for seq in self.sequences]
        self.results: list[Result | None] = [None] * B
        self.seeds = [config.sampling.seed] * len(self.prompts)   # each row's (the sampler draws them when none was given)
        self._t0 = time.perf_counter()
        self._prefill_s = 0.0
        self._t_first = None
        self._t_last = [None] * B
        self._stepped = False   # a decode step ran (the first token comes from the prompt's block)
        self.on_prefill = None   # optional callback(tokens prefilled, prompt tokens), after each prompt block
        self.prefill_block = PROGRESS_BLOCK   # tokens between two on_prefill calls (whole prefill chunks)
        self._it = self._run()

    # ------------------------------------------------------------------ iterator protocol
    def __iter__(self):
        return self

    def __next__(self) -> TokenEvent:
        return next(self._it)

    def close(self) -> None:
        """Stop generating and free the state (safe to call more than once)."""
        self._it.close()
        self.state = None

    @property
    def texts(self) -> list[str]:
        """The text each sequence has released so far."""
        return [seq.text for seq in self.sequences]

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.results)

    def run(self) -> list[Result]:
        """Generate to the end; return every sequence's result."""
        for _ in self:
            pass
        return self.results

    # ------------------------------------------------------------------ the loop
    _owns_state = False   # the state was allocated here (not a resumed one): its memory goes back at the end

    def _run(self):
        self._t0 = time.perf_counter()   # the clock starts at the first next(), not at construction
        model, cfg = self.model, self.config
        N, B = cfg.max_new_tokens, len(self.prompts)
        tokens, valid = left_pad(self.prompts, model.device)              # (B, P), (B, P) or None
        sampler = Sampler(cfg.sampling, B, model.config.vocab_size, model.device)
        self.seeds = sampler.seeds
        sampler.observe(tokens, valid)
        for row, held in zip(sampler.rows, self.seen or ()):
            if row.seen is not None and held:
                row.seen[0, torch.tensor(held, dtype=torch.long, device=row.seen.device)] = True
        try:
            t = time.perf_counter()
            logits = self._prefill(tokens, valid)                          # (B, V)
            self._prefill_s = time.perf_counter() - t
            for _ in range(N):   # each sequence's `max_new_tokens`-th id ends it ("length")
                nxt = sampler.sample(logits)                                # (B,)
                now = time.perf_counter()
                if self._t_first is None:
                    self._t_first = now
                for b, tok in enumerate(nxt.tolist()):
                    if self.results[b] is not None:
                        continue
                    text, reason = self.sequences[b].push(tok)
                    if reason is not None:
                        self._t_last[b] = now
                        self.results[b] = self.result(b, reason)
                        self.results[b].stop_reason = self.sequences[b].stop_reason
                    yield TokenEvent(b, tok, text, reason)
                if self.done:
                    return
                logits = self.step(nxt[:, None], self.state)[:, -1]        # (B, V)
                self._stepped = True
        finally:
            self.state = None   # the frame's last reference to the state goes with the generator
            if self._owns_state:   # its pages lie between the heap's live blocks: return them (not in a
                trim_heap(when_freed=True)   # server's loop, which trims once per idle spell)

    def _prefill(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """tokens (B, P) -> the last position's logits (B, V). With `on_prefill` set, a prompt longer than
        `prefill_block` (PROGRESS_BLOCK) runs in blocks of whole prefill chunks (the step cuts each block into the chunks
        it would cut the whole prompt into: the same arithmetic, the same tokens), and `on_prefill(done,
        total)` hears after each. (A padded batch, or a step that prefills in one block, runs whole.)"""
        P, chunk = tokens.shape[1], getattr(self.step, "chunk", 0)
        if self.on_prefill is None or valid is not None or not chunk or P <= self.prefill_block:
            return self.step(tokens, self.state, valid=valid, last_only=True)[:, -1]
        block = chunk * max(1, self.prefill_block // chunk)
        for start in range(0, P, block):
            logits = self.step(tokens[:, start:start + block], self.state, last_only=True)[:, -1]
            self.on_prefill(min(start + block, P), P)
        return logits

    def result(self, b: int = 0, reason: str | None = None) -> Result:
        """Sequence b's result; before it finishes, what it holds so far (finish_reason None)."""
        if self.results[b] is not None:
            return self.results[b]
        ids = self.ids[b]
        now = time.perf_counter()
        t_first = self._t_first if self._t_first is not None else now
        t_last = self._t_last[b] or now
        decode_s = max(t_last - t_first, 0.0) if ids else 0.0
        stats = Stats(prompt_tokens=len(self.prompts[b]), new_tokens=len(ids), prefill_s=self._prefill_s,
                      time_to_first_token_s=(t_first - self._t0) if ids else 0.0, decode_s=decode_s,
                      decode_tokens_per_s=(len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else 0.0,
                      state_bytes=self.state_bytes, attention=self.attention, batch=len(self.prompts),
                      seed=self.seeds[b], step_form=getattr(self.step, "last_form", None) if self._stepped else None)
        return Result(self.sequences[b].text, list(ids), reason, stats)


def allocate(model, **kw):
    """model.init_state(**kw); a state the machine cannot hold is an InvalidArgumentError, not torch's
    allocator error."""
    try:
        return model.init_state(**kw)
    except RuntimeError as e:   # torch.OutOfMemoryError (CUDA) is one too
        if not isinstance(e, torch.OutOfMemoryError) and "allocate memory" not in str(e):
            raise
        spec = kw.get("spec")
        window, sparse = getattr(spec, "window", 0) or 0, getattr(spec, "sparse_keys", 0) or 0
        if spec is not None and spec.attention == "linear" and (window or sparse):   # what a linear layer holds exactly
            held = f"a window of {window:,} keys" + (f" and {sparse:,} sparse keys" if sparse else "")
            raise InvalidArgumentError(f"the decoding state does not fit in memory: its linear layers hold {held} "
                                       f"a sequence; lower --window / --sparse-keys") from None
        raise InvalidArgumentError(f"a state for {kw['max_len']} tokens per sequence does not fit in memory; "
                                   f"lower max_context or max_new_tokens, or use linear attention") from None


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if not prompts:
        raise InvalidArgumentError("no prompts given; pass at least one prompt")
    out = []
    for p in prompts:
        p = [int(i) for i in p]
        if not p:
            raise InvalidArgumentError("the prompt is empty; give it at least one token")
        bad = [i for i in p if not 0 <= i < vocab_size]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        out.append(p)
    return out


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompts -> tokens (B, P) int64 padded on the left with id 0, and valid (B, P) bool
    (False at pads), or None when all prompts have the same length."""
    P = max(len(p) for p in prompts)
    tokens = torch.tensor([[0] * (P - len(p)) + p for p in prompts], dtype=torch.long, device=device)
    if all(len(p) == P for p in prompts):
        return tokens, None
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    valid = torch.arange(P, device=device)[None, :] >= (P - lengths)[:, None]
    return tokens, valid
