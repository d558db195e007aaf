"""Chat templates: a model's Jinja template turning messages into its prompt text, sandboxed.

    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>", where="model.gguf")
    text = template.render(messages, add_generation_prompt=True)
    ids = template.encode(tokenizer, messages, add_generation_prompt=True)
    template.end_of_turn(tokenizer.special_tokens)          # e.g. "<|im_end|>"

The source comes from a GGUF's `tokenizer.chat_template`, a directory's `chat_template.jinja` or
its `tokenizer_config.json` (`find_template`). Rendering runs in jinja2's
ImmutableSandboxedEnvironment with the globals Hugging Face templates use (`raise_exception`,
`strftime_now`, `tojson` with transformers' arguments) and `tools` / `documents` defined (None unless
given), as transformers' `apply_chat_template` does, so the prompt text is the same (its other special
tokens, `unk_token`, `pad_token`, are not passed). A template that fails to parse is a CheckpointError; one that raises while rendering
(`raise_exception("roles must alternate")`) an InvalidArgumentError: one line each.

Tokenizing: the template's markers (`<|im_start|>`...) are special tokens; the messages' text is
not. When no message contains a special-token string, the whole text is encoded with special
tokens parsed, exactly as transformers does. When one does, the prompt is cut around that message's
content and the content is encoded as plain text, so a user cannot close a turn by typing
"<|im_end|>" (PITFALLS #19); the pieces after a cut are encoded as continuations where the tokenizer
has them (a GGUF's SentencePiece: no "\u2581" added at the cut; a Hugging Face tokenizer.json of the
SentencePiece kind has none yet, and its pieces after a cut keep a leading "\u2581"). No BOS is added: a template that wants one writes it (PITFALLS #18).
"""
from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path

from models.errors import CheckpointError, InvalidArgumentError

ROLES_HINT = "list of {'role': ..., 'content': ...} dicts"
ROLES = ("system", "user", "assistant", "developer", "tool")   # those the server's schema accepts too
_MARK = "\ue000{}:{}\ue001"        # private-use characters around a nonce and a message index: where content goes
_PROBE = "\ue002PROBE\ue003"


class ChatTemplate:
    """check: parse the source now (a CheckpointError here if it does not parse); False: on first use
    (the loaders' choice: a run that never chats never imports jinja2 nor holds the compiled template,
    ~3.5 MB resident for SmolLM2's; the same CheckpointError then comes from that first use)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", where: str = "", check: bool = True):
        self.source, self.where = source, where
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self._template = None
        if check:
            self.template  # noqa: B018 (parsed now)

    @property
    def template(self):
        """The compiled template (jinja2, sandboxed), parsed once."""
        if self._template is None:
            from jinja2 import TemplateError  # lazy: `gen --model tiny` never needs it
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.source)
            except TemplateError as e:
                raise CheckpointError(f"{self.where}: the chat template does not parse ({_one_line(e)})") from None
        return self._template

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text of `messages`; add_generation_prompt: end with the assistant turn's opening."""
        messages = check_messages(messages)
        template = self.template   # (a CheckpointError if the source does not parse)
        extra = {"tools": None, "documents": None, **extra}   # as transformers: defined, None unless given
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except InvalidArgumentError:
            raise
        except Exception as e:   # the template's own raise_exception, or any error inside it
            raise InvalidArgumentError(f"the chat template refused these messages: {_one_line(e)}") from None

    def segments(self, messages, special_tokens, add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """The rendered text as (piece, is_user_text) pieces; "".join(pieces) == render(...).

        A message content holding a special-token string is its own piece (is_user_text True);
        everything else, template markers and ordinary content, is one piece encoded as a whole.
        """
        messages = check_messages(messages)
        text = self.render(messages, add_generation_prompt)
        risky = {i for i, m in enumerate(messages)
                 if isinstance(m.get("content"), str) and any(s in m["content"] for s in special_tokens)}
        if not risky:
            return [(text, False)]
        nonce = secrets.token_hex(8)   # (a user's text holding a marker of its own is not taken for one)
        marked = [dict(m, content=_MARK.format(nonce, i)) if i in risky else m for i, m in enumerate(messages)]
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", self.render(marked, add_generation_prompt))
        for strip in (False, True):   # a template may trim the content it inserts
            pieces = [(p, False) if j % 2 == 0 else
                      (messages[int(p)]["content"].strip() if strip else messages[int(p)]["content"], True)
                      for j, p in enumerate(parts)]
            pieces = [(p, is_user) for p, is_user in pieces if p]
            if "".join(p for p, _ in pieces) == text:
                return pieces
        raise InvalidArgumentError("a message holds a special-token string and the chat template changes "
                                   "message text, so it cannot be kept apart from the template's markers")

    def names_role(self, role: str) -> bool:
        """The template compares a message's role with `role` (a string literal of it in the source)."""
        named = self.__dict__.setdefault("_named_roles", {})   # (asked at every chat request: once per role)
        if role not in named:
            named[role] = re.search(f"""['"]{re.escape(role)}['"]""", self.source) is not None
        return named[role]

    def encode(self, tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered prompt (no BOS added: the template writes one if the model wants it)."""
        return encode_segments(tokenizer, self.segments(messages, tokenizer.special_tokens, add_generation_prompt))

    def end_of_turn(self, special_tokens) -> str | None:
        """The special token the template writes right after an assistant message (the turn end),
        found by rendering a probe reply; None if the template writes none."""
        for convo in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
                      [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": _PROBE}]):
            try:
                text = self.render(convo, add_generation_prompt=False)
            except InvalidArgumentError:
                continue
            after = text[text.find(_PROBE) + len(_PROBE):] if _PROBE in text else ""
            found = [s for s in special_tokens if after.startswith(s)]
            if found:
                return max(found, key=len)
            return None
        return None


def encode_segments(tokenizer, segments, after: str = "") -> list[int]:
    """Template pieces with special tokens parsed; user text as plain characters. A piece that goes on
    from text that did not end in a token matched whole is encoded as a continuation where the tokenizer
    has one (SentencePiece puts "\u2581" before a text and after each such token, not at a cut the text
    never had). after: the text before the first piece ("": none; a chat session's conversation so far)."""
    ids: list[int] = []
    going_on = getattr(tokenizer, "encode_continuation", None)
    whole = getattr(tokenizer, "whole_token_texts", None)
    whole = whole() if whole is not None else tuple(tokenizer.special_tokens)
    after_whole = not after or any(after.endswith(t) for t in whole)   # the text's start: the tokenizer's own rule
    for piece, is_user in segments:
        encode = tokenizer.encode if after_whole or going_on is None else going_on
        ids += encode(piece, special=not is_user)
        # (a user-defined token is matched whole even in user text; a special one only in the template's)
        after_whole = any(piece.endswith(t) for t in whole if not is_user or t not in tokenizer.special_tokens)
    return ids


def utf8_problem(text: str) -> str | None:
    """Why `text` is not valid UTF-8 ("byte 0xff at character 3": an undecodable byte kept by
    surrogateescape, as argv and stdin keep them; or a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        if "\udc80" <= char <= "\udcff":   # an undecodable byte (argv, stdin: surrogateescape)
            what = f"byte 0x{char.encode('utf-8', 'surrogateescape')[0]:02x}"
        else:                              # a lone surrogate, e.g. "\ud800" or half of a split pair
            what = f"a lone surrogate U+{ord(char):04X}"
        return f"{what} at character {e.start}"
    return None


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError(f"messages must be a non-empty {ROLES_HINT}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidArgumentError(f"each message must be a dict with string 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise InvalidArgumentError(f"unknown message role {m['role']!r:.40}; valid: {', '.join(ROLES)}")
        problem = utf8_problem(m["content"])
        if problem:
            raise InvalidArgumentError(f"the {m['role']} message is not valid UTF-8 ({problem}); pass UTF-8 text")
        out.append(dict(m))
    return out


def check_question(messages) -> None:
    """A reply needs something to answer: the last message may not be a user message that is empty or
    only whitespace (as `gen chat` refuses an empty line). Other blank messages (a system prompt, an
    assistant turn) are the caller's to send."""
    last = messages[-1] if isinstance(messages, (list, tuple)) and messages else None
    if isinstance(last, dict) and last.get("role") == "user" and isinstance(last.get("content"), str) \
            and not last["content"].strip():
        raise InvalidArgumentError("the last user message is empty or only whitespace; give it some text")


def find_template(directory: Path) -> str | None:
    """A directory's chat template: chat_template.jinja, else tokenizer_config.json's chat_template."""
    directory = Path(directory)
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        source = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{config}: not valid JSON ({e})") from None
    if isinstance(source, list):   # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    return source if isinstance(source, str) else None


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):   # transformers' filter
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


def _raise(message):
    from jinja2 import TemplateError  # lazy: `gen --model tiny` never needs it
    raise TemplateError(message)


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
