"""Incremental detokenization: text chunks released as tokens arrive, exactly the final text.

Decoding each token on its own is wrong twice over with SentencePiece: it drops the leading
space of every piece ("Daenerysisthe", llama2.c PR #1), and a character split across
byte-fallback tokens comes out as U+FFFD (TGI #131). Instead each step decodes the tokens
not yet released, with the tokenizer's `decode_continuation` (first token's space kept), and
releases that text unless it ends in U+FFFD: then the tokens end inside a character, and the
text waits for the token that completes it. Nothing else is held, so output without spaces streams token by token (transformers PR
#36708 held it back until a space). `finish()` flushes an incomplete tail as the tokenizer
decodes it, so the joined chunks always equal `decode_continuation(all ids)`.

Between two release points decoding is concatenative (decode_continuation(a + b) ==
decode_continuation(a) + decode_continuation(b) when `a` ends on a whole character), so each
step decodes only the tokens since the last release: constant cost per token.
"""
from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"


class StreamDecoder:
    """One sequence's detokenizer. tokenizer: anything with `decode_continuation(ids) -> str`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0      # ids[:start] are released; ids[start:] are held (mid-character)

    def push(self, token: int) -> str:
        """Add one token id; return the text it releases ("" while inside a character)."""
        self.ids.append(int(token))
        text = self.tokenizer.decode_continuation(self.ids[self.start:])
        if text.endswith(REPLACEMENT) and self._may_complete():
            return ""       # the bytes of a character are not all here yet
        self.start = len(self.ids)
        return text

    def _may_complete(self) -> bool:
        """Whether the held tokens end in bytes that a later token can still complete into a character.

        Bytes that can never complete one (a stray continuation byte such as three <0x80> tokens, or a
        lead byte followed by a non-continuation byte) are released at once as U+FFFD, as the tokenizer's
        own decode renders them. Byte-level BPE tokenizers give the held tokens' bytes (`bytes_of(ids)`);
        tokenizers with neither `bytes_of` nor `byte_value(id)` keep the plain rule (hold).
        """
        bytes_of = getattr(self.tokenizer, "bytes_of", None)
        if bytes_of is not None:   # byte-level BPE: tokens hold any number of bytes, look at them all
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            decoder.decode(bytes_of(self.ids[self.start:]), final=False)
            return bool(decoder.getstate()[0])
        byte_value = getattr(self.tokenizer, "byte_value", None)
        if byte_value is None:
            return True
        tail = bytearray()
        for i in reversed(self.ids[self.start:]):   # the run of byte tokens at the end of what is held
            b = byte_value(i)
            if b is None:
                break
            tail.insert(0, b)
        if not tail:
            return False    # the U+FFFD is the text of a whole token: nothing to wait for
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(bytes(tail), final=False)
        return bool(decoder.getstate()[0])   # bytes kept back = a valid, incomplete character

    def finish(self) -> str:
        """Release what is still held; an incomplete character decodes as the tokenizer says."""
        text = self.tokenizer.decode_continuation(self.ids[self.start:]) if self.start < len(self.ids) else ""
        self.start = len(self.ids)
        return text
