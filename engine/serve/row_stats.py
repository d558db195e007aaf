"""Per-request live numbers in a stream: the `gen` extension field of each chunk.

A streaming request that sends `"stream_options": {"include_stats": true}` gets, in every chunk,

    "gen": {"attention": "softmax", "prompt_tokens": 5, "completion_tokens": 12, "context": 17,
            "state_tokens": 16, "state_bytes": 393216, "batch_state_bytes": 786432, "batch_rows": 2,
            "ttft_ms": 41.2, "token_ms": 3.9, "ms_per_token": 4.1, "tokens_per_s": 243.9}

- context: prompt + completion tokens so far; state_tokens: those the state has consumed (the last
  sampled token is fed at the next step);
- state_bytes: this request's own row, holding state_tokens tokens: a KV row grows by a fixed
  number of bytes per token, a linear row (its S and z) does not grow, a window row holds its W-key
  buffer whole, a hybrid row is the sum of its parts. Measured on real batch-1 states of the served
  model (`RowBytes`), not the padded batch's capacity; that is batch_state_bytes (the whole batch
  state of this path now, batch_rows rows);
- ttft_ms: from the request's arrival at the server to its first token; token_ms: the decode step
  that produced this token (the gap since the previous one); ms_per_token and tokens_per_s: the
  mean over the decode so far (the first token excluded: it is the prefill's). Times are taken
  when the decode loop emits a token, not when the chunk reaches the client.

Other clients get OpenAI's chunks unchanged.
"""
from __future__ import annotations

import time
import weakref
from collections import deque

from engine.serve.scheduler import Token


class RowBytes:
    """Bytes of one sequence's state holding n tokens on each attention path: fixed + per_token * n,
    read from real batch-1 states of the model (1 and 2 slots, allocated once per path)."""

    def __init__(self, model, feature_map=None):
        self.model, self.feature_map, self.known = model, feature_map, {}

    def parts(self, path: str, spec=None) -> tuple[int, int]:
        """(fixed bytes, bytes per token) of a `path` row (spec: the row's run, when it has its own;
        `path` is then its key, Job.key)."""
        if path not in self.known:
            one, two = (self.model.init_state(batch=1, max_len=n, attention=None if spec else path,
                                              feature_map=self.feature_map, spec=spec).nbytes for n in (1, 2))
            self.known[path] = (2 * one - two, two - one)
        return self.known[path]

    def __call__(self, path: str, tokens: int, spec=None) -> int:
        fixed, per_token = self.parts(path, spec)
        return fixed + per_token * tokens


_row_bytes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def row_bytes(server) -> RowBytes:
    """The server's RowBytes (one per Server)."""
    rb = _row_bytes.get(server)
    if rb is None:
        rb = _row_bytes[server] = RowBytes(server.llm.model, server.scheduler.feature_map)
    return rb


class WithStats:
    """A stream format (engine.serve.app's CompletionFormat / ChatFormat) whose chunks carry `gen`.

        fmt = WithStats(fmt, job, server)    # before server.submit(job): it wraps job.emit

    Every other call goes to the wrapped format."""

    def __init__(self, fmt, job, server):
        self.fmt, self.job, self.server = fmt, job, server
        self.row_bytes = row_bytes(server)
        self.times: deque = deque()          # perf_counter at each Token's emit, in order
        self.first = self.last = None
        self.tokens, self.token_ms = 0, None
        emit = job.emit

        def stamped(ev):                     # the decode loop's thread
            if isinstance(ev, Token):
                self.times.append(time.perf_counter())
            emit(ev)
        job.emit = stamped

    def __getattr__(self, name):
        return getattr(self.fmt, name)

    def chunks(self, ev) -> list:
        """The wrapped format's chunks of one event, each with this row's numbers after it."""
        self._count(ev)
        out = self.fmt.chunks(ev)
        if out:
            stats = self.stats()
            for chunk in out:
                chunk["gen"] = stats
        return out

    def _count(self, ev) -> None:
        t = self.times.popleft() if self.times else time.perf_counter()
        self.tokens += 1
        if self.first is None:
            self.first = t
        else:
            self.token_ms = (t - self.last) * 1e3
        self.last = t

    def stats(self) -> dict:
        job, n = self.job, self.tokens
        prompt = len(job.ids)
        held = prompt + max(n - 1, 0)
        pool = self.server.scheduler.pools.get(job.key)
        state = getattr(pool, "state", None)
        decoded = self.last - self.first if self.first is not None else 0.0
        mean = decoded * 1e3 / (n - 1) if n > 1 and decoded > 0 else None
        return {"attention": job.path, "prompt_tokens": prompt, "completion_tokens": n, "context": prompt + n,
                "state_tokens": held, "state_bytes": self.row_bytes(job.key, held, job.spec),
                "batch_state_bytes": state.nbytes if state is not None else 0,
                "batch_rows": len(pool.rows) if pool is not None else 0,
                "ttft_ms": (self.first - job.submitted) * 1e3 if self.first is not None else None,
                "token_ms": self.token_ms, "ms_per_token": mean,
                "tokens_per_s": 1e3 / mean if mean else None}
