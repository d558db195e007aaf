"""What the HTTP layer serves: one loaded model, its scheduler, and how a request becomes a Job.

    server = Server(llm, name="tiny", max_batch=16, max_context=256)
    app = create_app(server)            # engine.serve.app; uvicorn.run(app, host=..., port=...)

Limits. `max_batch` sequences decode at once (both paths together); up to `max_queue` more wait
for a row; beyond that a request gets 429 with Retry-After. On the softmax path a sequence holds
at most `max_context` tokens, prompt included (a longer prompt is a 400; `max_tokens` is cut to
what fits, finish_reason "length"), so the KV caches never exceed max_batch x 2 x max_context
slots (rows are right-aligned to the longest); a hybrid sequence's KV layers count the same way.
A linear sequence (with or without a sliding window) has no context limit; there `max_context` is
only the default cap on generated tokens. `max_prompt` bounds a prompt's tokens on every path
(default: max_context, so a linear prompt costs no more prefill time and memory than the longest
softmax one; 0: no limit): a longer one is a 400 `context_length_exceeded` before it is queued.
A request that waits in the queue longer than `queue_timeout` seconds (0: forever) leaves it with
a 503 and Retry-After. `max_tokens_cap` bounds the tokens a request may generate, on every path:
a larger `max_tokens` is clamped to it (finish_reason "length", as llama-server clamps n_predict;
as the softmax context already clamps). Default (None): the context on a KV path (what fits), and
DEFAULT_LINEAR_MAX_TOKENS_CAP on a linear one, where nothing else would bound it: 16 linear
streams asking 10^12 tokens with ignore_eos would hold every row forever. 0: no cap (a KV path is
still bounded by its context).
"""
from __future__ import annotations

from engine.errors import EngineError
import functools
import hashlib
import os

from engine.sampling import SamplingParams, check_vocab
from engine.serve.errors import APIError, bad_request, model_not_found, over_capacity, shutting_down
from engine.serve.prefix_cache import PrefixCache
from engine.serve.scheduler import PREFILL_SHARE, Closed, Full, Job, Scheduler
from engine.serve.schemas import ChatRequest, CompletionRequest
from models.chat_template import check_question

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
RETRY_AFTER_S = 1
DEFAULT_QUEUE_TIMEOUT_S = 60.0
DEFAULT_LINEAR_MAX_TOKENS_CAP = 4096   # tokens a linear request may generate unless --max-tokens-cap says

SPACES = "".join(c for c in map(chr, range(0x3001)) if c.isspace())   # every character str.isspace holds


class Server:
    def __init__(self, llm, name: str, max_batch: int = 16, max_context: int | None = None,
                 max_queue: int | None = None, cache: PrefixCache | None = None, max_prompt: int | None = None,
                 queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, max_tokens_cap: int | None = None,
                 aliases: tuple[str, ...] = (), prefill_share: float = PREFILL_SHARE):
        if max_batch < 1:
            raise bad_request(f"max_batch must be >= 1, got {max_batch}")
        if max_queue is not None and max_queue < 0:
            raise bad_request(f"max_queue must be >= 0, got {max_queue}")
        if max_prompt is not None and max_prompt < 0:
            raise bad_request(f"max_prompt must be >= 0 (0 = no limit), got {max_prompt}")
        if max_tokens_cap is not None and max_tokens_cap < 0:
            raise bad_request(f"max_tokens_cap must be >= 0 (0 = no cap), got {max_tokens_cap}")
        if not queue_timeout >= 0:
            raise bad_request(f"queue_timeout must be >= 0 seconds (0 = no limit), got {queue_timeout}")
        if not 0 <= prefill_share < float("inf"):
            raise bad_request(f"prefill_share must be a number >= 0 (decode steps' time), got {prefill_share}")
        self.llm, self.name = llm, name
        self.names = (name,) + tuple(a for a in aliases if a != name)   # what clients may send as `model`
        self.max_context = max_context or llm.model.config.max_position_embeddings
        self.max_prompt = self.max_context if max_prompt is None else max_prompt
        self.queue_timeout, self.retry_after = queue_timeout, RETRY_AFTER_S
        self.max_tokens_cap = max_tokens_cap
        self._chat_eos: frozenset | None = None
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._fingerprints: dict = {}
        self.scheduler = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=max_batch, max_queue=max_queue,
                                   feature_map=llm.feature_map, cache=cache, prefill_share=prefill_share,
                                   kv_headroom=min(self.max_context, self.max_prompt or self.max_context))
        self.fingerprint = fingerprint(llm, name)

    # ------------------------------------------------------------------ requests -> jobs
    def check_model(self, name: str | None) -> None:
        """A request's `model` must be one of `names`; none given: the served model (as vLLM and
        llama-server take it)."""
        if name is not None and name not in self.names:
            raise model_not_found(name, self.name)

    def check_chars(self, texts: list[str], what: str) -> None:
        """Texts of more characters than max_prompt tokens can cover are a 400 before they are tokenized
        or rendered (megabytes of them held Python's lock for seconds while other streams waited): by
        the tokenizer's `chars_per_token` bound, on the non-whitespace characters (none where the
        tokenizer has no such bound)."""
        chars = sum(map(len, texts))
        if not self.max_prompt or chars <= self.max_prompt:
            return
        bound = getattr(self.llm.tokenizer, "chars_per_token", lambda: None)()   # (the tokenizer keeps it)
        limit = None if bound is None else self.max_prompt * bound
        if limit is None or chars <= limit:
            return
        solid = chars - sum(text.count(c) for text in texts for c in SPACES)   # what str.split drops
        if solid > limit:
            raise bad_request(f"The {what} {'have' if what == 'messages' else 'has'} {solid} characters besides "
                              f"spaces, more than the {self.max_prompt} tokens this server takes per request "
                              f"(gen serve --max-prompt) can hold (a token covers at most {bound} "
                              "here). Shorten it.", what, "context_length_exceeded")

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, str):
            if self.llm.tokenizer is None:
                raise bad_request("this model ships no tokenizer; send the prompt as token ids", "prompt")
            self.check_chars([prompt], "prompt")
            try:
                return self.llm.encode(prompt)
            except EngineError as e:
                raise bad_request(str(e), "prompt") from None
        V = self.llm.model.config.vocab_size
        bad = [i for i in prompt if not 0 <= i < V]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{V - 1})", "prompt")
        return list(prompt)

    def chat_ids(self, req: ChatRequest) -> list[int]:
        """The prompt ids of the messages through the model's chat template (models.chat_template, as
        `llm.chat` renders them: template markers as special tokens, message text as plain text)."""
        if self.max_prompt and len(req.messages) > self.max_prompt:   # before rendering them (100k took seconds)
            raise bad_request(f"The messages are {len(req.messages)}, more than the {self.max_prompt} tokens this server "
                              "takes per request (gen serve --max-prompt) can hold (a message takes at least one). "
                              "Shorten the conversation.", "messages", "context_length_exceeded")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        template = self.llm.chat_template
        if template is not None and not template.names_role("developer"):   # OpenAI's newer name for the
            messages = [dict(m, role="system") if m["role"] == "developer" else m for m in messages]   # system one
        if self.llm.tokenizer is not None:
            self.check_chars([m["content"] or "" for m in messages], "messages")
        try:
            check_question(messages)
        except EngineError as e:
            raise bad_request(str(e), "messages") from None
        try:
            if self._chat_eos is None:
                self._chat_eos = frozenset(self.llm.chat_eos_ids())   # raises if the model cannot chat
            return self.llm.chat_template.encode(self.llm.tokenizer, messages, add_generation_prompt=True)
        except EngineError as e:
            raise bad_request(f"{e}; use /v1/completions", "messages", "chat_unavailable") from None

    def make_job(self, req, ids: list[int], emit, default_max_tokens: int | None) -> Job:
        """The Job for a parsed request (its `copies` are the other choices when n > 1; every choice's
        Token goes to `emit`, with its index); a 400 APIError for what the request may not ask."""
        what = "messages" if isinstance(req, ChatRequest) else "prompt"
        if self.max_prompt and len(ids) > self.max_prompt:
            raise bad_request(f"The prompt has {len(ids)} tokens; this server takes at most {self.max_prompt} per "
                              "request (gen serve --max-prompt). Shorten it.", what, "context_length_exceeded")
        spec = self.request_spec(req)
        path = spec.attention
        layers = spec.layer_paths(self.llm.model.config.num_hidden_layers)
        if "softmax" in layers:    # a KV cache on some layer: the context limit holds
            room = self.max_context - len(ids)
            if room < 1:
                raise bad_request(f"This model's maximum context length is {self.max_context} tokens; the prompt "
                                  f"has {len(ids)}. Shorten it, or use attention=linear (no context limit).",
                                  what, "context_length_exceeded")
            max_tokens = min(req.limit or default_max_tokens or room, room, self.tokens_cap(kv=True))
        else:
            max_tokens = min(req.limit or default_max_tokens or self.max_context, self.tokens_cap(kv=False))
        if req.n > self.scheduler.max_batch:
            raise bad_request(f"n={req.n} choices need {req.n} batch rows; this server decodes at most "
                              f"{self.scheduler.max_batch} sequences at once (gen serve --max-batch)", "n")
        seeds = choice_seeds(req.seed, req.n)
        greedy = req.top_p == 0   # OpenAI's top_p 0: only the most likely token
        try:
            params = [SamplingParams(temperature=0.0 if greedy else req.temperature, top_k=req.top_k,
                                     top_p=1.0 if greedy else req.top_p, min_p=req.min_p,
                                     repetition_penalty=req.repetition_penalty, seed=seed,
                                     presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                     logit_bias=req.token_bias) for seed in seeds]
            check_vocab(params[0], self.llm.model.config.vocab_size)
        except EngineError as e:   # the message starts with the parameter's name
            name = str(e).split(" ", 1)[0].rstrip(":")
            raise bad_request(str(e), name if name in type(req).model_fields else None, "invalid_value") from None
        stop = () if req.stop is None else ((req.stop,) if isinstance(req.stop, str) else tuple(req.stop))
        if stop and self.llm.tokenizer is None:
            raise bad_request("stop strings need a tokenizer, and this model ships none", "stop")
        if isinstance(req, ChatRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        eos = self._chat_eos if isinstance(req, ChatRequest) else None   # a reply also ends at the turn's end
        jobs = [Job(ids=ids, path=path, spec=spec, params=p, max_tokens=max_tokens, emit=emit, stop=stop, logprobs=logprobs,
                    ignore_eos=req.ignore_eos, eos_ids=eos, index=i) for i, p in enumerate(params)]
        jobs[0].copies = jobs[1:]
        return jobs[0]

    def request_spec(self, req):
        """The run a request asks for: its attention, softmax_layers, window and sparse_keys resolved against the
        checkpoint's config by the rules `gen --attention ...` goes through (RunSpec.for_request), so
        `attention: linear` means on this model what `gen --attention linear` means; none given: the
        server's own run. A bad value, or a run needing a set of learned maps this server did not
        load, is a 400 naming the field. So is a window or sparse_keys of more keys than max_context:
        each row allocates them whole (`window: 10**6` alone would take gigabytes)."""
        for field in ("window", "sparse_keys"):
            asked = getattr(req, field)
            if asked is not None and asked > self.max_context:
                raise bad_request(f"{field} {asked} is over this server's context of {self.max_context} tokens "
                                  f"(every row holds that many keys per layer); ask at most {self.max_context} "
                                  "(gen serve --max-context)", field, "invalid_value")
        try:
            spec = self.llm.spec.for_request(self.llm.model.config, req.attention, req.softmax_layers, req.window,
                                             req.sparse_keys)
        except EngineError as e:
            text = str(e)
            first = text.split(" ", 1)[0]
            param = ("window" if first == "--window" else "sparse_keys" if first == "--sparse-keys" else
                     "softmax_layers" if first == "--softmax-layers" or text.startswith("softmax layer ")
                     else "attention")
            raise bad_request(text, param, "invalid_value") from None
        held, wants = self.map_set_of(self.llm.spec), self.map_set_of(spec)
        if wants != held:
            raise bad_request(f"{spec.describe()} runs {self.name}'s {wants or 'default'} set of learned maps; this "
                              f"server holds its {held or 'default'} set (for {self.llm.spec.describe()}): serve it "
                              f"with gen serve --attention {spec.attention}"
                              + (f" --window {spec.window}" if spec.linear_window else ""),
                              "window" if req.window is not None else "attention", "invalid_value")
        return spec

    def map_set_of(self, spec) -> str | None:
        """The set of learned maps `spec` runs on this checkpoint (None: its default set)."""
        return spec.map_set if spec.map_set in getattr(self.llm, "map_sets", ()) else None

    def tokens_cap(self, kv: bool) -> float:
        """The most tokens a request may generate on a path with (kv) or without a KV cache (inf: no cap)."""
        cap = self.max_tokens_cap
        if cap is None:
            cap = 0 if kv else DEFAULT_LINEAR_MAX_TOKENS_CAP
        return cap or float("inf")

    def submit(self, job: Job) -> None:
        try:
            self.scheduler.submit(job)
        except Full:
            raise over_capacity(RETRY_AFTER_S) from None
        except Closed:
            raise shutting_down(RETRY_AFTER_S) from None

    @property
    def draining(self) -> bool:
        """A shutdown has begun: nothing more is admitted (engine.serve.shutdown)."""
        return self.scheduler.closed

    def token_text(self, i: int) -> str:
        """One token's text as logprobs show it (memoised: every streamed token with logprobs asks). A
        token holding part of a character is its bytes as OpenAI writes them, "bytes:\\xe4\\xbd" (its
        decoded text would be U+FFFD, the same for every such token: top_logprobs keys would collide)."""
        text = self._token_texts.get(i)
        if text is None:
            tok = self.llm.tokenizer
            raw = self.token_bytes(i)
            try:
                raw.decode("utf-8")
                text = tok.decode_continuation([i]) if tok is not None else ""
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_texts[i] = text
        return text

    def token_bytes(self, i: int) -> bytes:
        """The bytes one token adds to a reply's UTF-8 text (chat logprobs' `bytes`; a byte-fallback
        or byte-level piece: its own byte, not U+FFFD's three)."""
        raw = self._token_bytes.get(i)
        if raw is None:
            tok = self.llm.tokenizer
            if tok is None:
                raw = b""
            elif hasattr(tok, "bytes_of"):
                raw = tok.bytes_of([i])
            else:
                byte = tok.byte_value(i) if hasattr(tok, "byte_value") else None
                raw = bytes([byte]) if byte is not None else tok.decode_continuation([i]).encode("utf-8")
            self._token_bytes[i] = raw
        return raw

    def fingerprint_for(self, spec) -> str:
        """The system_fingerprint of a request's run (its attention, layers, window and sparse keys decide
        its tokens as much as the model does); the server's own run: `fingerprint`."""
        if spec == self.llm.spec:
            return self.fingerprint
        fp = self._fingerprints.get(spec)
        if fp is None:
            if len(self._fingerprints) >= 64:   # clients choose the runs: a bounded memo
                self._fingerprints.clear()
            fp = self._fingerprints[spec] = fingerprint(self.llm, self.name, spec)
        return fp


def choice_seeds(seed: int | None, n: int) -> list:
    """The seeds of a request's n choices: seed + i (mod 2**63), so choice 0 is the n = 1 answer; a
    negative seed (OpenAI clients send -1) or none: random (one OS draw for the n of them)."""
    if seed is None or seed < 0:
        if n == 1:
            return [None]
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    return [(seed + i) % 2 ** 63 for i in range(n)]


@functools.lru_cache(maxsize=1)
def engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gen-engine")
    except PackageNotFoundError:
        return "dev"


def fingerprint(llm, name: str, spec=None) -> str:
    """OpenAI's system_fingerprint: what, besides the seed, decides the tokens (the model, its run: the
    attention, softmax layers, window and sparse keys, `spec` or the server's own; dtype, device and step
    form, the prefill chunk, the engine's version): equal fingerprints and seeds, equal answers."""
    cfg = llm.model.config
    spec = llm.spec if spec is None else spec
    run = (spec.attention, spec.layer_paths(cfg.num_hidden_layers), spec.linear_window, spec.linear_sparse_keys,
           spec.map_set)
    parts = (engine_version(), name, run, str(llm.feature_map), str(next(llm.model.parameters()).dtype),
             str(llm.model.device),
             getattr(llm.step, "backend", None), getattr(llm.step, "prefill_chunk", None), cfg.vocab_size,
             cfg.num_hidden_layers, cfg.hidden_size)
    return "fp_" + hashlib.sha256(repr(parts).encode()).hexdigest()[:10]


__all__ = ["Server", "APIError", "COMPLETION_DEFAULT_MAX_TOKENS"]
