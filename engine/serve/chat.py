"""Chat messages -> prompt ids through the model's chat template (Jinja, sandboxed).

The template is the model directory's `chat_template.jinja`, or the `chat_template` of its
`tokenizer_config.json` (the Hugging Face layouts). It is rendered with `messages`,
`add_generation_prompt=True`, `bos_token` and `eos_token`; the text is then encoded without
adding a BOS of its own (a template that wants one writes `{{ bos_token }}`: no double BOS,
PITFALLS #18).
"""
from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.serve.errors import bad_request


class ChatTemplate:
    def __init__(self, source: str, tokenizer):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.tokenizer = tokenizer

    @classmethod
    def find(cls, model_path, tokenizer) -> "ChatTemplate | None":
        """The template shipped next to the weights, or None."""
        root = Path(model_path)
        root = root if root.is_dir() else root.parent
        jinja = root / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(encoding="utf-8"), tokenizer)
        config = root / "tokenizer_config.json"
        if config.is_file():
            source = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(source, list):   # named templates: take "default"
                source = next((t.get("template") for t in source if t.get("name") == "default"), None)
            if isinstance(source, str):
                return cls(source, tokenizer)
        return None

    def render(self, messages: list[dict]) -> str:
        tok = self.tokenizer
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=_piece(tok, tok.bos_id), eos_token=_piece(tok, tok.eos_id))
        except TemplateError as e:
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.render(messages)
        if "special" in _params(self.tokenizer.encode):
            return self.tokenizer.encode(text, bos=False, special=True)
        bos = _piece(self.tokenizer, self.tokenizer.bos_id)
        if bos and text.startswith(bos):   # SentencePiece reads "<s>" as characters: the id instead
            return self.tokenizer.encode(text[len(bos):], bos=True)
        return self.tokenizer.encode(text, bos=False)


def _raise(message):
    raise TemplateError(message)


def _piece(tokenizer, i) -> str:
    if i is None or i < 0:
        return ""
    sp = getattr(tokenizer, "sp", None)
    if sp is not None:
        return sp.id_to_piece(i)
    to_token = getattr(tokenizer, "id_to_token", None)
    return (to_token(i) or "") if to_token else ""


def _params(fn) -> tuple:
    return fn.__code__.co_varnames[:fn.__code__.co_argcount]
