"""Request bodies of the OpenAI endpoints, checked strictly (wrong types and unknown fields are 400s).

The fields OpenAI defines plus the engine's own (`top_k`, `min_p`, `repetition_penalty`,
`attention`, `softmax_layers`, `window`, `ignore_eos`). Fields OpenAI defines that this engine does not implement are accepted only at
their neutral value (`best_of` 1, no `echo`, `response_format` text: structured output is refused
with a 400 naming it). `n` choices (up to MAX_N), `presence_penalty` / `frequency_penalty`,
`logit_bias`, a negative `seed` (random) and `top_p` 0 (greedy) are OpenAI's.
`ignore_eos` (vLLM's name) runs to max_tokens whatever is sampled: fixed-length benchmark runs.
"""
from __future__ import annotations

import re

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.serve.errors import bad_request

MAX_TOP_LOGPROBS = 20
MAX_N = 16        # choices per request (each is a batch row: the server refuses more than its max_batch)
MAX_LOGIT_BIAS = 300   # tokens a logit_bias may name (OpenAI's limit)


def _null_is_the_default(cls, data):
    """OpenAI types its optional fields `T | null`, null meaning the default (clients send
    `"temperature": null`): a null optional field is left out, then takes its default. A required
    field's null stays, to be refused by name."""
    if isinstance(data, dict):
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
    return data


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    include_stats: bool = False       # the engine's own: a `gen` field in every chunk (engine.serve.row_stats)

    _nulls = model_validator(mode="before")(classmethod(_null_is_the_default))


class Sampling(BaseModel):
    """What both endpoints share."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)   # NaN: "a finite number", not "<= 2"

    model: str | None = None          # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)             # 0: greedy
    seed: int | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 63)   # negative: random
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # the engine's own
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    # the run's attention, as gen's --attention / --softmax-layers / --window on the served model, checked
    # by the same rules (engine.runspec: a bad value is a 400 with the CLI's one-line message)
    attention: str | None = None
    softmax_layers: str | list[int] | None = None
    window: int | None = None
    sparse_keys: int | None = None    # with a window: hard keys per linear layer and head kept exact
    ignore_eos: bool = False          # as vLLM: run to max_tokens (benchmarks)

    _nulls = model_validator(mode="before")(classmethod(_null_is_the_default))

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt):
        if fmt is not None and fmt.type != "text":
            if fmt.type in ("json_object", "json_schema"):
                raise ValueError(f"type {fmt.type!r} is not supported: this server has no structured "
                                 "(JSON-constrained) output yet; send type 'text' or leave response_format out")
            raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {fmt.type!r}")
        return fmt

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, bias):
        if bias:
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
            for key, value in bias.items():
                # ASCII digits: "²".isdigit() but int("²") fails, and int("9" * 5000) is refused
                if not re.fullmatch(r"[0-9]{1,12}", key.strip()):
                    raise ValueError(f"keys must be token ids (strings of digits), got {key!r}")
                if not -100 <= value <= 100:
                    raise ValueError(f"values must be in [-100, 100], got {value} for token {key}")
        return bias

    @model_validator(mode="after")
    def _neutral_only(self):
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise FieldError("stop", "stop takes at most 4 sequences")
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise FieldError("stop", "stop sequences must be non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def token_bias(self) -> dict[int, float]:
        """logit_bias with integer token ids."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def include_stats(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_stats)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise FieldError("prompt", "one prompt per request (batched prompts are not supported)")
            self.prompt = p[0]
        if self.prompt == "" or self.prompt == []:
            raise FieldError("prompt", "the prompt is empty")
        for name, given in (("echo", self.echo), ("best_of", self.best_of != 1), ("suffix", self.suffix)):
            if given:
                raise FieldError(name, "echo, best_of and suffix are not supported")
        return self


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_given(self):
        if self.content is None and self.role != "assistant":   # OpenAI: only an assistant's may be null
            raise FieldError("content", f"a {self.role} message needs content (a string or a list of content parts), "
                                        "not null")
        for part in self.content if isinstance(self.content, list) else ():
            if not isinstance(part.get("type"), str):
                raise FieldError("content", 'each content part needs a string "type", e.g. {"type": "text", "text": '
                                            '"..."}')
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise FieldError("content", 'a text content part needs a string "text": {"type": "text", "text": '
                                            '"..."}')
        return self

    def text(self) -> str:
        if isinstance(self.content, list):   # content parts: the text ones, a line each (as vLLM joins them)
            return "\n".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        return self


class FieldError(ValueError):
    """A check across fields that names the one the client should change (the error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


REQUEST_FIELDS = frozenset(name for model in (ResponseFormat, StreamOptions, CompletionRequest, Message, ChatRequest)
                           for name in model.model_fields)


def _param(loc) -> str | None:
    """pydantic's location as the client wrote it: ("messages", 0, "role") -> "messages[0].role"; the
    union member it tried ("stop", "str") is no field of the request: the path ends before it."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in REQUEST_FIELDS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def parse(cls, raw):
    """A JSON value -> a request model, or a 400 APIError naming the offending field."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":   # the unknown key itself ends the path
            param = ".".join(filter(None, (_param(err["loc"][:-1]), str(err["loc"][-1]))))
        if isinstance(cause, FieldError):
            param = ".".join(filter(None, (param, cause.param)))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: {param}", param, "missing_required_parameter") from None
        where = f"{param}: " if param else ""
        raise bad_request(f"{where}{msg}", param, "invalid_value") from None
