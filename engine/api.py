"""The Python API: load a model once, then stream or generate.

    from engine import load
    llm = load("tiny", attention="linear")
    for chunk in llm.stream("Once upon a time", max_new_tokens=200, temperature=0.8, seed=1):
        print(chunk, end="", flush=True)
    r = llm.generate("Once upon a time", max_new_tokens=50, temperature=0)
    r.text, r.ids, r.finish_reason, r.stats.decode_tokens_per_s
    rs = llm.generate(["Once", "The dog"], temperature=0)       # a batch: a list of results
    llm = load("smollm2")                                           # a chat model (GGUF + template)
    for chunk in llm.chat([{"role": "user", "content": "Hi!"}], temperature=0): ...
    session = llm.chat_session(); session.send("Hi!"); session.send("And then?")   # engine.chat

A prompt is text (encoded with BOS first) or a list of token ids (used as given: add the BOS
id yourself if the model wants one), for checkpoints that ship no tokenizer. Every call has
its own state and its own sampler, so streams on one `LLM` are independent of each other.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence

import torch

from engine.attention import get_feature_map
from engine.errors import CheckpointError, ConfigError, InvalidArgumentError
from engine.chat import ChatSession
from engine.generate import Closing, Generation, GenerationConfig, Result, eos_set
from engine.loader import load_parts
from engine.sampling import SamplingParams, chat_sampling
from engine.state_io import SavedState, check_same_run, load as load_state_file, save as save_state_file
from engine.runspec import (DEFAULT_ACTIVATIONS, DEFAULT_PREFILL_CHUNK, RunSpec, check_activations, check_attention,
                            check_backend, check_prefill_chunk, check_sparse_keys, check_threads, check_window)
from engine.steps import Stepper
from engine.quant import quantize_model
from engine.threads import available_cores, set_threads
from models.chat_template import check_question, utf8_problem
from models.pages import trim_heap
from models.registry import path_warning

Prompt = str | Sequence[int]


class UntrainedPathWarning(UserWarning):
    """The chosen attention path is not one the weights were trained for."""


class QuantizeWarning(UserWarning):
    """Some matrices could not be quantized as asked and stay in float."""


class ThreadsWarning(UserWarning):
    """More threads were asked for than this process has cores: they will wait on each other."""


def load(model: str = "tiny", attention: str | None = None, feature_map: str | None = None,
         device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
         backend: str = "auto", threads: int | None = None, native: bool = False,
         quantize: str | None = None, softmax_layers=None, window: int | None = None,
         kv_dtype: str | torch.dtype | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
         activations: str = DEFAULT_ACTIVATIONS, sparse_keys: int | None = None) -> "LLM":
    """Load a registered model name (`tiny`) or a checkpoint path; attention None = the model's own.

    backend: which form runs one-token decode steps (engine.steps): "auto" (default: the C step
    where it applies, else PyTorch), "torch", "native", or "module" (the reference).
    native=True is an alias of backend="native". threads: CPU threads (default: engine.threads).
    quantize: "q8_0", "q4_0" or "q4_1" keeps the matrices as quantized blocks (engine.quant).
    attention="hybrid", softmax_layers=[2, 9, 11] (or "auto:K"): those layers keep a KV cache, the
    rest run linear; window=W: linear layers also attend exactly to the last W keys; sparse_keys=M
    (with a window): each linear layer and head also keeps the M keys its state recalls worst exact
    (engine.attention.sparse; None: the checkpoint's own with its own mode, else 0)
    (engine.runspec.RunSpec.resolve says what each combination means).
    kv_dtype: the KV cache's dtype (default: the model's), e.g. "float16" under fp32 weights, as
    llama.cpp keeps its cache: half the cache's bytes, keys and values rounded to 16 bits.
    activations: what quantized weights multiply in the native step: "f32-prompt" (default: prompt
    blocks with fp32 activations, decode steps with q8-rounded ones, as llama.cpp decodes), "f32"
    (PyTorch's arithmetic throughout: the module and torch steps' tokens) or "q8" (rounded throughout:
    faster, less exact).
    prefill_chunk: prompts are prefilled in blocks of at most this many tokens (0: one block), as
    `gen --prefill-chunk` and `gen serve` do, so the same request gives the same tokens everywhere;
    None (the default): 16 where the C step prefills (a CPU, f16 or quantized weights), 512 on the
    PyTorch path (a GPU, fp32 / bf16 weights), `llm.step.chunk` says which.

    Every option is resolved once, with the checkpoint's config, into `LLM.spec` (engine.runspec.RunSpec,
    where the rules live); warns (UntrainedPathWarning) when `attention` is a path the weights were
    not trained for.
    """
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise InvalidArgumentError(f"model must be a registered name (e.g. tiny) or a checkpoint path, got {model!r:.60}")
    if attention is not None:
        check_attention(attention)
    if feature_map is not None:
        get_feature_map(feature_map)
    options = dict(attention=attention, softmax_layers=softmax_layers, window=window, feature_map=feature_map,
                   dtype=dtype, kv_dtype=kv_dtype, device=device, backend=backend, native=native, threads=threads,
                   quantize=quantize, activations=activations, prefill_chunk=prefill_chunk, sparse_keys=sparse_keys)
    check_window(window)
    check_sparse_keys(sparse_keys)
    check_threads(threads)
    if threads is not None and threads > available_cores():
        warnings.warn(f"threads={threads} is more than the {available_cores()} cores this process may run on; "
                      f"the threads wait on each other at every step (each token much slower)", ThreadsWarning,
                      stacklevel=2)
    net, tokenizer, template, sampling, map_sets = load_parts(model, spec=lambda cfg: RunSpec.resolve(cfg, **options))
    spec = net.spec
    set_threads(threads)   # PyTorch's own pool is process-wide; the native step's count travels in the spec
    if spec.quantize is not None:
        kept = quantize_model(net, spec.quantize)
        if kept:   # (blocks are 32 wide: the rule is documented, the outcome was silent)
            total = 4 * net.config.num_hidden_layers + 1
            warnings.warn(f"quantize={spec.quantize}: {len(kept)} of {total} matrices stay in float (their input width "
                          f"is not a multiple of 32): {', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}",
                          QuantizeWarning, stacklevel=2)
    trim_heap()   # what reading the checkpoint freed (metadata, tokenizer build) goes back to the kernel
    llm = LLM(net, tokenizer, name=str(model), chat_template=template, sampling=sampling, spec=spec,
              feature_map=feature_map, _stacklevel=3)
    llm.map_sets = map_sets
    return llm


class LLM:
    """A loaded model + tokenizer (or None) + the attention path and feature map to run.

    sampling: the sampling defaults the checkpoint names (models.generation_config); chats use them
    over llama.cpp's (`chat_sampling`)."""

    def __init__(self, model, tokenizer=None, attention: str | None = None, feature_map: str | None = None,
                 name: str | None = None, backend: str = "auto", chat_template=None,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, sampling: dict | None = None,
                 activations: str = DEFAULT_ACTIVATIONS, _stacklevel: int = 2, spec: RunSpec | None = None):
        """spec: the run (what `load` resolves); without it, the model's default run on `attention`
        with `feature_map`, `backend`, `prefill_chunk` and `activations`."""
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.chat_template = chat_template       # models.chat_template.ChatTemplate or None
        self.sampling = dict(sampling or {})
        if feature_map is not None:
            get_feature_map(feature_map)
        if spec is None:
            spec = dataclasses.replace(model.run_spec(attention, feature_map), backend=check_backend(backend),
                                       prefill_chunk=check_prefill_chunk(prefill_chunk),
                                       activations=check_activations(activations))
        self.spec = spec
        self.step = Stepper(model, spec.backend, threads=spec.threads, prefill_chunk=spec.prefill_chunk,
                            activations=spec.activations)   # what the generation loop calls
        # the step's one-time weight copies now, not in the first prompt's prefill time (on a state of
        # one slot, its window and sparse keys capped: what a run asks for is checked when it runs)
        probe = dataclasses.replace(spec, window=min(spec.window, 64), sparse_keys=min(spec.sparse_keys, 64))
        self.step.prepare(lambda: model.init_state(batch=1, max_len=1, spec=probe))
        self.attention = spec.attention
        self.feature_map = feature_map   # as given (None: the model's); the run's: spec.feature_map
        self.map_sets: tuple[str, ...] = ()   # the checkpoint's other sets of learned maps (load() fills it)
        message = path_warning(model.config, self.attention)
        if message:
            warnings.warn(message.removeprefix("warning: "), UntrainedPathWarning, stacklevel=_stacklevel)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt, call: str = "encode()") -> list[int]:
        """Text -> [BOS] + its ids; a sequence of ids (or a 1-D tensor) -> a list, unchanged.

        `call` names the public call in error messages (InvalidArgumentError).
        """
        if isinstance(prompt, str):
            check_text(prompt, call)
            if self.tokenizer is None:
                raise InvalidArgumentError(f"{call}: this model ships no tokenizer; pass the prompt as token ids "
                                           f"(in the CLI: --ids 1,2,3)")
            return self.tokenizer.encode(prompt, bos=True)
        if isinstance(prompt, (bytes, bytearray, memoryview)):   # a Sequence of ints, but never meant as ids
            raise InvalidArgumentError(f"{call}: a prompt is text (str) or a list of token ids, got "
                                       f"{type(prompt).__name__}; decode it first: prompt.decode('utf-8')")
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or not all(_is_int(i) for i in prompt):
            raise InvalidArgumentError(f"{call}: a prompt is text or a list of token ids, got {describe(prompt)}")
        if not prompt:
            raise InvalidArgumentError(f"{call}: the prompt is empty; give some text or token ids")
        return [int(i) for i in prompt]

    # ------------------------------------------------------------------ generating
    def start(self, prompts: Sequence[Prompt], **settings) -> Generation:
        """A batch as an iterator of TokenEvents (row, id, text, finish_reason); see engine.generate."""
        return self._start(prompts, settings, "start()")

    def _start(self, prompts, settings: dict, call: str) -> Generation:
        config = make_config_for(call, settings)
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
            raise InvalidArgumentError(f"{call}: expected a list of prompts, got {describe(prompts)}")
        return Generation(self.model, [self.encode(p, call) for p in prompts], config, self.tokenizer,
                          spec=self.spec, step=self.step)

    def stream(self, prompt: Prompt, **settings) -> "TextStream":
        """Iterate text chunks as they are generated; `.result` afterwards. Settings: see `make_config`."""
        if self.tokenizer is None:
            raise InvalidArgumentError("stream(): this model ships no tokenizer, so there is no text to stream; "
                                       "use start() for token events or generate() for ids")
        if is_batch(prompt):
            raise InvalidArgumentError(f"stream(): takes one prompt (text or a list of token ids), got "
                                       f"{describe(prompt)}; for a batch use generate([...]) or start([...])")
        return TextStream(self._start([prompt], settings, "stream()"))

    def generate(self, prompt: Prompt | Sequence[Prompt], **settings) -> Result | list[Result]:
        """One prompt -> a Result; a list of prompts -> a list of Results (one batch). Settings: make_config."""
        single = not is_batch(prompt)   # anything else goes through encode(), which names what is wrong
        results = self._start([prompt] if single else list(prompt), settings, "generate()").run()
        return results[0] if single else results

    # ------------------------------------------------------------------ saved states
    def prefill(self, prompt: Prompt, max_len: int | None = None) -> SavedState:
        """Run `prompt` through the model: a SavedState holding all its tokens but the last, which
        `resume` feeds first. max_len: KV cache capacity (default: the model's context)."""
        check_max_len(max_len, "prefill()")
        ids = self.encode(prompt, "prefill()")
        state = self.model.init_state(batch=1, max_len=max(max_len or self.model.config.max_position_embeddings,
                                                           len(ids)),
                                      spec=self.spec)
        if len(ids) > 1:
            self.step(torch.tensor([ids[:-1]], device=self.model.device), state, last_only=True)
        return SavedState(state, ids[:-1], ids[-1:])

    def save_state(self, path, saved: SavedState) -> None:
        """Write a SavedState (from `prefill`) as safetensors, with this model's identity (engine.state_io)."""
        check_saved(saved, "save_state()")
        save_state_file(path, saved, self.model)

    def load_state(self, path, max_len: int | None = None) -> SavedState:
        """Read a state saved by `save_state`; StateMismatchError if another model or shape saved it.
        max_len: KV cache capacity (default: the model's context). A state of another run (attention,
        softmax layers, window, sparse keys, feature map) is a StateMismatchError too: it would decode
        as that run."""
        check_max_len(max_len, "load_state()")
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"load_state(): path must be a file path, got {describe(path)}")
        if not os.path.exists(path):
            raise CheckpointError(f"{os.fspath(path)}: no such file; give the file llm.save_state() wrote")
        return load_state_file(path, self.model, max_len=max_len or self.model.config.max_position_embeddings,
                               spec=self.spec)   # (another run's state refused before it is allocated)

    def resume(self, saved: SavedState, more: Sequence[int] = (), **settings) -> Generation:
        """Continue from a SavedState: feeds its next ids (then `more` ids), generates as `start` does.
        The state is used in place (resume a fresh load to continue twice). Settings: make_config."""
        check_saved(saved, "resume()")
        check_same_run(saved.state, self.model, self.spec, "resume()")   # it would decode as its own run
        config = make_config_for("resume()", settings)
        return Generation(self.model, [list(saved.next_ids) + self.encode(list(more), "resume()") if more
                                       else list(saved.next_ids)], config, self.tokenizer,
                          spec=self.spec, step=self.step, state=saved.state)

    # ------------------------------------------------------------------ chat
    @property
    def chat_sampling(self) -> dict:
        """A chat's sampling settings where the caller gives none: the model's generation config where
        it names them, else llama.cpp's truncation (engine.sampling.chat_sampling)."""
        try:
            return chat_sampling(self.sampling)
        except InvalidArgumentError as e:
            raise ConfigError(f"{self.name or 'this model'}: {e}") from None

    def chat(self, messages, **settings) -> "TextStream":
        """Stream the assistant's reply to `messages` ([{"role": ..., "content": ...}, ...]), rendered
        with the model's chat template; settings: those of `stream`, each one not given taken from
        `chat_sampling`. Stops at the turn's end token."""
        template = self._template()
        check_question(messages)   # the messages themselves are checked where the template renders them
        settings = {**self.chat_sampling, **settings}
        settings.setdefault("eos_ids", self.chat_eos_ids())
        ids = template.encode(self.tokenizer, messages, add_generation_prompt=True)
        return TextStream(self._start([ids], settings, "chat()"))

    def chat_session(self, system: str | None = None, max_context: int | None = None) -> ChatSession:
        """A conversation that keeps its decoding state between turns (engine.chat): `send(text,
        **settings)` streams a reply and prefills only the tokens the turn adds; `reset()` starts over.
        Settings not given come from `chat_sampling`.
        max_context: softmax KV cache capacity in tokens (default: the model's context)."""
        return ChatSession(self.model, self.tokenizer, self._template(),
                           lambda s: make_config_for("chat_session().send()", {**self.chat_sampling, **s}),
                           self.chat_eos_ids(), attention=self.attention, feature_map=self.feature_map,
                           step=self.step, system=system, max_context=max_context, spec=self.spec)

    def chat_eos_ids(self) -> tuple[int, ...]:
        """The ids that end a reply: the config's and tokenizer's EOS plus the template's turn end."""
        ids = eos_set(self.model.config, self.tokenizer)
        turn_end = self._template().end_of_turn(self.tokenizer.special_tokens)
        if turn_end is not None and self.tokenizer.token_to_id(turn_end) is not None:
            ids.add(self.tokenizer.token_to_id(turn_end))
        return tuple(sorted(ids))

    def _template(self):
        if self.chat_template is None:
            raise InvalidArgumentError(f"{self.name or 'this model'} has no chat template (a chat model carries "
                                       f"one in its GGUF, tokenizer_config.json or chat_template.jinja); generate "
                                       f"from a plain prompt instead")
        if self.tokenizer is None or not hasattr(self.tokenizer, "special_tokens"):
            raise InvalidArgumentError(f"{self.name or 'this model'} has a chat template but no byte-level BPE "
                                       f"tokenizer (tokenizer.json or GGUF) to encode it; use stream() with a prompt")
        return self.chat_template


def check_text(text: str, call: str) -> None:
    """A text prompt must be valid UTF-8 (no lone surrogates from undecodable bytes) and not blank."""
    problem = utf8_problem(text)
    if problem:
        raise InvalidArgumentError(f"{call}: the prompt is not valid UTF-8 ({problem}); pass UTF-8 text")
    if not text.strip():
        raise InvalidArgumentError(f"{call}: the prompt is empty or only whitespace; give some text or token ids")


def check_max_len(max_len, call: str) -> None:
    """max_len: None (the model's context) or a whole number of tokens >= 1."""
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise InvalidArgumentError(f"{call}: max_len must be a whole number of tokens >= 1 (None: the model's "
                                   f"context), got {max_len!r:.40}")


def check_saved(saved, call: str) -> None:
    if not isinstance(saved, SavedState):
        raise InvalidArgumentError(f"{call}: expected a SavedState (from llm.prefill() or llm.load_state()), "
                                   f"got {describe(saved)}")


def describe(x) -> str:
    """A short description of a value for error messages: its type, and for lists what they hold."""
    if isinstance(x, (list, tuple)):
        kinds = sorted({type(i).__name__ for i in x})
        return f"a {type(x).__name__} of {len(x)} ({', '.join(kinds) or 'nothing'})"
    return type(x).__name__


SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop",
            "eos_ids", "ignore_eos", "max_context", "presence_penalty", "frequency_penalty", "logit_bias")


def make_config_for(call: str, settings: dict) -> GenerationConfig:
    """make_config(**settings), with unknown names refused as InvalidArgumentError naming `call`."""
    unknown = [k for k in settings if k not in SETTINGS]
    if unknown:
        raise InvalidArgumentError(f"{call}: unknown setting {unknown[0]!r}; valid: {', '.join(SETTINGS)}")
    try:
        return make_config(**settings)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{call}: {e}") from None


def make_config(*, max_new_tokens: int = 256, temperature: float = 0.8, top_k: int = 0,
                top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                seed: int | None = None, stop: str | Sequence[str] | None = None,
                eos_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                max_context: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                logit_bias: dict[int, float] | None = None) -> GenerationConfig:
    """The settings every generating call takes as keyword arguments, checked (InvalidArgumentError).

    temperature 0 = greedy; top_k 0, top_p 1, min_p 0, repetition_penalty 1 = off (engine.sampling);
    presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]) 0 = off; logit_bias: {token id:
    bias in [-100, 100]}; seed None = fresh; stop: strings that end the text (cut before them);
    eos_ids None = the model's and tokenizer's EOS ids; max_context: softmax context per sequence (engine.generate).
    """
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, logit_bias=logit_bias or ())
    return GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                            eos_ids=eos_ids,
                            ignore_eos=ignore_eos, max_context=max_context)


class TextStream(Closing):
    """An iterator of one prompt's text chunks (never empty strings).

    The state is freed when the generation ends, when `close()` is called (or a `with` block
    left), or when the stream is dropped: `for chunk in llm.stream(...): break` frees it at
    the break. A stream kept in a variable can be resumed after a break until it is closed.
    """

    def __init__(self, generation: Generation):
        self.generation = generation

    def __iter__(self):
        return self

    def __next__(self) -> str:
        for event in self.generation:
            if event.text:
                return event.text
        raise StopIteration

    def close(self) -> None:
        self.generation.close()

    def __del__(self):
        # The Generation and its loop's generator reference each other, so without this the
        # state of a stream left by `break` would wait for the cycle collector.
        self.close()

    @property
    def state(self):
        return self.generation.state

    @property
    def result(self) -> Result:
        """The finished result, or what was generated so far (finish_reason None)."""
        return self.generation.result(0)


def is_single_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 1
    if isinstance(prompt, Sequence) and prompt and all(_is_int(i) for i in prompt):
        return True
    return False


def is_batch(prompt) -> bool:
    """A non-empty sequence of prompts (rather than one prompt)."""
    return isinstance(prompt, Sequence) and bool(prompt) and not is_single_prompt(prompt)


def _is_int(x) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, torch.Tensor) and x.dim() == 0)
