"""The `gen` model for lm-evaluation-harness (lm-eval, `pip install -e '.[eval]'`).

    from engine import load
    from engine.tasks.adapter import GenLM
    import lm_eval
    lm = GenLM(load("smollm2-linear", attention="linear"))
    lm_eval.simple_evaluate(model=lm, tasks=["piqa"], limit=100)
    lm_eval.simple_evaluate(model="gen", model_args="model=smollm2,attention=softmax", tasks=[...])   # by name
    lm_eval.simple_evaluate(model="gen", model_args={"llm": llm}, tasks=[...])   # what `gen eval` does

lm-eval finds "gen" once this module is imported, or lazily once `engine.tasks.harness.register()`
has named it in lm-eval's registry (so `gen` itself never imports lm-eval before a task runs).

An `lm_eval.api.model.TemplateLM`: requests are tokenized exactly as lm-eval's own `hf` model does
(`TemplateLM.loglikelihood`: trailing spaces of a context moved onto the continuation, the pair
encoded whole and split; an empty context replaced by the prefix token: BOS, else EOS; BOS added
where the model's tokenizer adds one), then scored by `engine.tasks.scoring.Scorer`, which prefills
each shared context once, on whatever attention path the loaded model runs. A context + continuation
longer than `max_length` + 1 tokens is cut from the left, as `hf` does.

`loglikelihood_rolling` scores a text in disjoint windows of `max_length` tokens (lm-eval's
`get_rolling_token_windows`); `generate_until` runs the engine's own generation loop (greedy unless
the task asks for sampling) and returns the text as `hf` does: special tokens dropped, cut before
the first stop string.
"""
from __future__ import annotations

import inspect
import warnings

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from engine.api import LLM, load, make_config
from engine.errors import InvalidArgumentError
from engine.generate import Generation
from engine.quant import dequantize_model
from engine.tasks.scoring import Scorer, ScoreStats

GENERATE_BATCH = 8   # prompts per generation batch
LOAD_ARGS = frozenset(inspect.signature(load).parameters) - {"model"}   # what model_args may pass on to load()


@register_model("gen")
class GenLM(TemplateLM):
    """llm: an `engine.api.LLM` (its model, tokenizer, attention path and feature map), or `model=`
    a registered name or path loaded with `load()`'s keyword arguments (attention, softmax_layers,
    window, feature_map, dtype, quantize, threads). max_length: tokens a request may hold (default:
    the model's trained positions). batch_tokens: padded tokens per model call (engine.tasks.scoring);
    stats: a ScoreStats the scorer adds its counts to; length_option: how the caller sets max_length, for the
    advice of a request that does not fit (`gen eval` says "--context N").
    A model holding quantized blocks is dequantized once, in place (scoring runs the float form of the
    weights). batch_size and max_batch_size, which lm-eval passes to every model, are not used: batches
    are sized in tokens."""

    def __init__(self, llm: LLM | None = None, *, model: str | None = None, max_length: int | None = None,
                 batch_tokens: int = 2048, dequantize: bool = True, stats: ScoreStats | None = None, batch_size=None,
                 device=None, max_batch_size=None, length_option: str = "model_args max_length=N", **load_kwargs):
        super().__init__()
        if llm is None:
            if model is None:
                raise InvalidArgumentError("GenLM needs an LLM or model=<registered name or path>")
            unknown = sorted(set(load_kwargs) - LOAD_ARGS)
            if unknown:
                raise InvalidArgumentError(f"GenLM: not an argument of the gen model: {', '.join(unknown)} (model_args "
                                           f"take model, max_length, batch_tokens, dequantize and load()'s "
                                           f"{', '.join(sorted(LOAD_ARGS))})")
            if device is not None and _absent(str(device)):
                # lm-eval's command line names cuda:0 unless told otherwise; its own hf model then takes what the
                # machine has, and so does this one (saying so)
                warnings.warn(f"GenLM: device {device} is not on this machine; running on the CPU", stacklevel=2)
            elif device is not None:
                load_kwargs["device"] = device
            args = {k: _arg(v) for k, v in load_kwargs.items()}
            if "softmax_layers" in args:
                args["softmax_layers"] = _layers(args["softmax_layers"])
            llm = load(model, **args)
        elif model is not None or load_kwargs:
            raise InvalidArgumentError("GenLM: give an LLM or model=... with load() arguments, not both")
        if llm.tokenizer is None:
            raise InvalidArgumentError(f"{llm.name or 'this model'} ships no tokenizer; lm-eval tasks are text")
        if dequantize:
            dequantize_model(llm.model)
        self.llm, self.tokenizer, self.length_option = llm, llm.tokenizer, length_option
        # as `hf` reads a text: special-token strings as their ids where the tokenizer can (a SentencePiece
        # .model file reads them as text), and the prefix token's text, which lm-eval's has_bos_prefix
        # compares a text's start with (-1: a tokenizer with neither BOS nor EOS)
        self._special = {"special": True} if "special" in inspect.signature(llm.tokenizer.encode).parameters else {}
        prefix = self.prefix_token_id
        self._prefix_text = llm.tokenizer.decode([prefix]) if self._special and prefix >= 0 else ""
        self._max_length = int(max_length) if max_length is not None else None
        if self._max_length is not None and self._max_length < 2:
            raise InvalidArgumentError(f"max_length must be at least 2 tokens, got {max_length}")
        try:
            batch_tokens = int(batch_tokens)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"batch_tokens must be a whole number of tokens, got {batch_tokens!r:.40}") from None
        self.scorer = Scorer(llm.model, attention=llm.attention, feature_map=llm.feature_map,
                             batch_tokens=batch_tokens, stats=stats)

    # ------------------------------------------------------------------ what TemplateLM asks for
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return bos if bos is not None and bos >= 0 else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length or self.llm.model.config.max_position_embeddings

    @property
    def max_gen_toks(self) -> int:
        return 256

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As `hf` encodes: special-token strings in the text ("<s>", "<|endoftext|>") are their single
        ids, as a Hugging Face tokenizer's encode reads them (where the tokenizer can: a SentencePiece
        .model file reads them as text); add_special_tokens None: BOS where the model's tokenizer adds
        one, unless the text already starts with the prefix token's text; False: never."""
        bos = add_special_tokens is not False
        if add_special_tokens is None and bos and self._prefix_text and string.startswith(self._prefix_text):
            bos = False
        return self.tokenizer.encode(string, bos=bos, **self._special)

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) strings or None, context ids, continuation ids)."""
        pairs = []
        for _, ctx, cont in requests:
            cont = list(cont)
            if len(cont) > self.max_length:   # (`hf` asserts; cutting it would score another text)
                raise InvalidArgumentError(f"a continuation of {len(cont)} tokens is longer than max_length "
                                           f"{self.max_length}: raise max_length ({self.length_option})")
            whole = (list(ctx) + cont)[-(self.max_length + 1):]  # at least one context token is left
            pairs.append((whole[:-len(cont)], cont))
        with tqdm(total=len(pairs), disable=disable_tqdm, desc="Running loglikelihood requests") as bar:
            out = self.scorer.score(pairs, progress=bar.update)
        for (strings, _, _), answer in zip(requests, out):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(r)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, scores):
            totals[r] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for idx in by_kwargs.values():
            kwargs = dict(requests[idx[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0 if not sample else 1.0))
            config = make_config(max_new_tokens=max_new, temperature=temperature if sample else 0.0,
                                 stop=until or None, seed=int(kwargs.pop("seed", 0)),
                                 max_context=self.max_length)
            keep = self.max_length - max_new
            if keep < 1:   # (`hf` asserts: a prompt cut to nothing answers another question)
                raise InvalidArgumentError(f"max_gen_toks {max_new} leaves no room for the prompt in max_length "
                                           f"{self.max_length}: lower the task's max_gen_toks or raise max_length ({self.length_option})")
            prompts = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in idx}
            order = sorted(idx, key=lambda i: len(prompts[i]))
            for b in range(0, len(order), GENERATE_BATCH):
                chunk = order[b:b + GENERATE_BATCH]
                gen = Generation(self.llm.model, [prompts[i] for i in chunk], config, self.tokenizer,
                                 attention=self.llm.attention, feature_map=self.llm.feature_map, step=self.llm.step)
                for i, result in zip(chunk, gen.run()):
                    out[i] = self._text(result.ids, until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, result.text)
                bar.update(len(chunk))
        bar.close()
        return out


    def _text(self, ids, until) -> str:
        """As `hf` returns a generation: special tokens (EOS...) dropped, cut before the first stop string."""
        special = set(getattr(self.tokenizer, "special_tokens", {}).values()) | {self.eot_token_id}
        text = self.tokenizer.decode([i for i in ids if i not in special])
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


def _absent(device: str) -> bool:
    """A CUDA device named on a machine without one (lm-eval's default is cuda:0)."""
    return device.startswith("cuda") and not torch.cuda.is_available()


def _layers(value):
    """softmax_layers from model_args: lm-eval splits them on commas, so a list is written 3;5;9 (or
    one number, which its parser makes an int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str) and not value.startswith("auto:"):
        return ",".join(value.replace(";", " ").split())
    return value


def _arg(value):
    """model_args come as strings from lm-eval's command line: "none" -> None, digits -> int."""
    if isinstance(value, str):
        if value.lower() in ("none", "null", ""):
            return None
        if value.isdigit():
            return int(value)
    return value
