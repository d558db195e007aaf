"""Stop rules: EOS ids, stop strings, and the reason a sequence finished.

finish_reason is one of
  "stop"    an id of the EOS set was sampled, or a stop string appeared;
  "length"  max_new_tokens were generated;
  "context" the softmax KV cache is full (the linear state never fills).

Stop strings are matched on the detokenized text, so a stop string spread over several
tokens is found wherever the token boundaries fall. `StopText` holds back only the tail of
the text that could still be the beginning of a stop string and releases it as soon as it
cannot; on a match, the text is cut just before the stop string and nothing of it is ever
released (vLLM #3574, llama.cpp PR #9867). When stop strings overlap, the one completed first
wins (ties: the one starting first), which a stream can decide without seeing the future;
so the cut does not depend on how the text was split into chunks.
"""
from __future__ import annotations

from engine.errors import InvalidArgumentError
from models.chat_template import utf8_problem

FINISH_REASONS = ("stop", "length", "context")


def check_stop_strings(stop) -> tuple[str, ...]:
    """None, a string, or a sequence of non-empty strings -> a tuple of them."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r:.60}")
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InvalidArgumentError(f"stop strings must be non-empty strings, got {s!r}")
        problem = utf8_problem(s)
        if problem:   # it could never match the text, which is UTF-8
            raise InvalidArgumentError(f"stop string {s!r} is not valid UTF-8 ({problem}); pass UTF-8 text")
    return stop


class StopText:
    """One sequence's stop-string filter over its stream of text chunks."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.held = ""          # released text that might still begin a stop string
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add a chunk; return the text now safe to release. After a match, returns "" forever."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return text
        pending = self.held + text
        best = None                            # (end, start, stop string) of the first completed match
        for s in self.stop:
            i = pending.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.matched, self.held = best[2], ""
            return pending[:best[1]]
        keep = self._may_begin_stop(pending)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def finish(self) -> str:
        """The sequence ended without a match: release what was held."""
        out, self.held = self.held, ""
        return out if self.matched is None else ""

    def _may_begin_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
