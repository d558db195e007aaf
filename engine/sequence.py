"""One sequence's finish rules, for every loop that decodes: `Generation` (the API and the CLI) and the
server's scheduler both feed each sampled id to a `Sequence` and send what it says.

    seq = Sequence(tokenizer, stop=("\\n\\n",), eos=frozenset({2}), max_tokens=64, room=None)
    text, reason = seq.push(token_id)     # the text this id releases, and "stop" / "length" /
                                          # "context" on the sequence's last id (else None)

In this order: an id of the EOS set ends it ("stop", no text); else the id goes through the
detokenizer (engine.detokenize) and the stop-string filter (engine.stopping), and a stop string
ends it ("stop", the text cut before it); else the `max_tokens`-th id ends it ("length"); else an id
that could not be fed back without passing the context ends it ("context": `room` ids may be fed
back; None: no limit). On the last id, the detokenizer's held tail and the stop filter's held text
are flushed into its text, so a sequence's texts joined equal its whole continuation.
"""
from __future__ import annotations

from engine.detokenize import StreamDecoder
from engine.stopping import StopText


class Sequence:
    """One sequence's detokenizer, stop filter, EOS set and limits. tokenizer None: every text is ""
    (EOS and the limits still apply; stop strings need a tokenizer). ids: the list the sampled ids are
    appended to (default: a new one)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), eos=frozenset(), max_tokens: int | None = None,
                 room: int | None = None, ids: list[int] | None = None):
        self.decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.stopper = StopText(stop)
        self.eos, self.max_tokens, self.room = eos, max_tokens, room
        self.ids: list[int] = [] if ids is None else ids
        self.text = ""                                # text released so far
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None     # with "stop": the EOS id sampled, or the stop string

    def push(self, tok: int) -> tuple[str, str | None]:
        """One sampled id -> (the text it releases, the finish reason if it is the sequence's last)."""
        self.ids.append(tok)
        n, text, reason = len(self.ids), "", None
        if tok in self.eos:
            reason, self.stop_reason = "stop", tok
        elif self.decoder is not None:
            text = self.stopper.push(self.decoder.push(tok))
            if self.stopper.matched is not None:
                reason, self.stop_reason = "stop", self.stopper.matched
        if reason is None and self.max_tokens is not None and n >= self.max_tokens:
            reason = "length"
        if reason is None and self.room is not None and n > self.room:
            reason = "context"   # feeding `tok` back would need one more cache slot
        if reason is not None:
            text += flush(self.decoder, self.stopper)
            self.finish_reason = reason
        self.text += text
        return text, reason


def flush(decoder, stopper) -> str:
    """At a sequence's end: release the detokenizer's tail, then the stop filter's held text."""
    tail = decoder.finish() if decoder is not None else ""
    return stopper.push(tail) + stopper.finish()


def eos_set(model_config, tokenizer, eos_ids=None) -> set[int]:
    """The ids that end a sequence: the given ones, else the config's and the tokenizer's together
    (they disagree in some checkpoints: transformers #31362)."""
    if eos_ids is not None:
        return set(eos_ids)
    ids = set(model_config.eos_ids)
    if tokenizer is not None and tokenizer.eos_id is not None and tokenizer.eos_id >= 0:
        ids.add(tokenizer.eos_id)
    return ids


__all__ = ["Sequence", "eos_set", "flush"]
