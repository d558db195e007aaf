"""A chat session: the conversation and its decoding state, kept between turns.

    session = llm.chat_session(system="You are terse.")
    for chunk in session.send("What is the capital of France?", temperature=0):
        print(chunk, end="")
    session.send("And of Italy?")           # prefills only the tokens this turn adds
    session.reset()

The state is append-only, on both attention paths: a linear state cannot be rewound, so a turn
never re-feeds what the state already holds. After a reply the state holds the prompt and every
sampled token but the last (the loop samples it and stops); a turn then feeds that last token
unless it was an end token, followed by exactly the text the template adds after the reply (the
turn end, the next user message, the assistant opening), tokenized as `models.chat_template`
does (markers as special tokens, user text as plain text). The reply stays in the state as the
ids that were sampled, not a re-tokenization of its text.

When the template does not extend the previous rendering (a template that rewrites earlier turns),
or a reply was broken off inside a step (an exception from the model: the state may be half
written), the next turn rebuilds the state from the whole conversation instead; `rebuilds` counts
these, and `stats` of each reply says how many tokens were prefilled.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

from engine.errors import InvalidArgumentError, SessionBusyError
from engine.generate import Closing, Generation, GenerationConfig, Result
from models.chat_template import ChatTemplate, check_messages, encode_segments


class ChatSession:
    """One conversation on one model, one reply at a time. A send(), reset() or a reply's close() from
    another thread while a thread is inside the reply's next chunk is a SessionBusyError (the conversation
    is left as it was); between chunks a send() closes the last reply, as in one thread. A session per
    thread for conversations side by side."""

    def __init__(self, model, tokenizer, template: ChatTemplate, configure: Callable[[dict], GenerationConfig],
                 eos_ids, attention: str, feature_map: str | None = None, step=None, system: str | None = None,
                 max_context: int | None = None, spec=None):
        if max_context is not None and (not isinstance(max_context, int) or isinstance(max_context, bool)
                                        or max_context < 1):
            raise InvalidArgumentError(f"max_context must be an integer >= 1, got {max_context!r}")
        if system is not None:   # checked now, not at the first message: a bad one is the session's error
            if not isinstance(system, str):
                raise InvalidArgumentError(f"system must be a string, got {type(system).__name__}")
            check_messages([{"role": "system", "content": system}])
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.configure, self.eos_ids = configure, tuple(eos_ids)
        self.attention, self.feature_map, self.step = attention, feature_map, step
        self.spec = model.run_spec(attention, feature_map, spec)   # the run (engine.runspec.RunSpec)
        self.system, self.max_context = system, max_context or model.config.max_position_embeddings
        self.rebuilds = 0
        self.reply: ChatReply | None = None
        self.reading = threading.RLock()   # held while a reply steps or closes, and while send() runs
        self.reset()

    @contextmanager
    def alone(self, call: str):
        """Around what steps or changes the conversation: held by this thread (again: an RLock), or
        SessionBusyError naming `call` when another thread is inside the reply's next chunk."""
        if not self.reading.acquire(blocking=False):
            raise SessionBusyError(f"{call}: another thread is reading this session's reply; a session is one "
                                   f"conversation, one reply at a time: use a session per thread")
        try:
            yield
        finally:
            self.reading.release()

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and free the state."""
        with self.alone("chat_session().reset()"):
            self._reset()

    def _reset(self) -> None:
        self.close_reply()
        # (system="": an empty system message, which keeps a template's default one out, as llm.chat renders it)
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.state = None
        self.text = ""             # the rendered conversation text the state holds
        self.pending: list[int] = []   # sampled ids the state does not hold yet (the last reply's last token)
        self.held: list[int] = []      # every token of the conversation so far (a repetition penalty's prompt)
        self.dirty = False

    def close_reply(self) -> None:
        if self.reply is not None:
            self.reply.close()

    def send(self, content: str, **settings) -> "ChatReply":
        """Add a user message and stream the reply (text chunks). Settings: those of `LLM.stream`."""
        if not isinstance(content, str):
            raise InvalidArgumentError(f"a message is a string, got {type(content).__name__}")
        if not content.strip():
            raise InvalidArgumentError("the message is empty; type some text")
        if "max_context" in settings:   # the state's capacity, fixed when the session began
            raise InvalidArgumentError("max_context is the session's, not a turn's: llm.chat_session(max_context=N)")
        with self.alone("chat_session().send()"):
            return self._send(content, settings)

    def _send(self, content: str, settings: dict) -> "ChatReply":
        self.close_reply()
        settings.setdefault("eos_ids", self.eos_ids)
        config = self.configure(settings)
        messages = self.messages + [{"role": "user", "content": content}]
        segments = self.template.segments(messages, self.tokenizer.special_tokens, add_generation_prompt=True)
        full = "".join(piece for piece, _ in segments)
        if self.state is not None and not self.dirty and full.startswith(self.text):
            state, held = self.state, self.held
            ids = self.pending + encode_segments(self.tokenizer, cut(segments, len(self.text)), after=self.text)
        else:
            state, held = self.model.init_state(batch=1, max_len=self.max_context, spec=self.spec,
                                                device=self.model.device), []
            ids = encode_segments(self.tokenizer, segments)
        # (a Generation refused here, e.g. a full context, leaves the session as it was: a rebuild still due)
        generation = Generation(self.model, [ids], config, self.tokenizer, spec=self.spec, step=self.step,
                                state=state, seen=[held])   # a repetition penalty sees the whole conversation
        if state is not self.state:
            self.rebuilds += self.state is not None
            self.state, self.dirty = state, False
        self.reply = ChatReply(self, generation, messages, full, held + ids)
        return self.reply

    def _finish(self, reply: "ChatReply", broken: bool) -> None:
        """Record the reply in the conversation and what the state now holds."""
        ids = reply.generation.ids[0]
        eos = set(reply.generation.eos)
        ended = bool(ids) and ids[-1] in eos
        text = self.tokenizer.decode(ids[:-1] if ended else ids)
        if broken and not ids:   # stopped before the reply began (in the message's prefill): never answered,
            self.messages, self.dirty, self.reply = reply.messages[:-1], True, None   # the message is withdrawn
            return
        self.messages = reply.messages + [{"role": "assistant", "content": text}]
        self.text = reply.prompt_text + text
        self.pending = [] if ended or not ids else [ids[-1]]
        # the conversation's tokens (the pending one too; an EOS that ended the reply is the template's to
        # write: the next turn's text holds it)
        self.held = reply.held + list(ids[:-1] if ended else ids)
        self.dirty = self.dirty or broken or not ids
        self.reply = None


class ChatReply(Closing):
    """An iterator of one reply's text chunks; `.result` afterwards (or what was generated so far).

    Leaving the loop early (`break`, `close()`) keeps the session usable: the reply so far becomes
    the assistant's message.
    """

    def __init__(self, session: ChatSession, generation: Generation, messages: list[dict], prompt_text: str,
                 held: list[int] = ()):
        self.session, self.generation = session, generation
        self.messages, self.prompt_text = messages, prompt_text
        self.held = list(held)   # the conversation's tokens once this turn's are fed (before the reply's)
        self.finished = False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.finished:
            raise StopIteration
        with self.session.alone("chat_session() reply"):
            try:
                for event in self.generation:
                    if event.text:
                        return event.text
                self._end(broken=False)
            except BaseException:   # raised inside a step: the state may be half written
                self._end(broken=True)
                raise
        raise StopIteration

    def close(self) -> None:
        if self.finished:
            return
        with self.session.alone("chat_session() reply's close()"):   # (send() closing the last reply holds it)
            self.generation.close()
            self._end(broken=False)

    def _end(self, broken: bool) -> None:
        if not self.finished:
            self.finished = True
            self.session._finish(self, broken)

    @property
    def result(self) -> Result:
        return self.generation.result(0)

    def text(self) -> str:
        """Run the reply to its end and return its whole text."""
        return "".join(self)


def cut(segments: list[tuple[str, bool]], n: int) -> list[tuple[str, bool]]:
    """The segments of a rendered text without its first n characters."""
    out = []
    for piece, is_user in segments:
        if n >= len(piece):
            n -= len(piece)
            continue
        out.append((piece[n:], is_user))
        n = 0
    return out
