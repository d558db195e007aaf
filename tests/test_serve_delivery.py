"""How serve's tokens travel from the decode loop to the client: the mailbox wakes the event loop once
per scheduler flush (not once per token) and keeps order; the scheduler flushes after every iteration
and counts its time; a stream sends every event already waiting in one write, framed exactly as
sse-starlette frames one event."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("sse_starlette")

from sse_starlette.event import ServerSentEvent   # noqa: E402

from engine.sampling import SamplingParams   # noqa: E402
from engine.serve.app import CompletionFormat, Mailbox, sse, sse_stream   # noqa: E402
from engine.serve.scheduler import Failure, Job, Scheduler, Token   # noqa: E402


class CountingLoop:
    """What Mailbox needs of an event loop, counting the wake-ups."""

    def __init__(self):
        self.wakeups = []

    def call_soon_threadsafe(self, fn):
        self.wakeups.append(fn)


def test_mailbox_wakes_the_loop_once_per_flush_and_keeps_order():
    loop = CountingLoop()
    box = Mailbox(loop)
    queues = [asyncio.Queue(), asyncio.Queue()]
    for i in range(16):
        box.post(queues[i % 2], i)
    assert loop.wakeups == []                     # posting alone never wakes the loop
    box.flush()
    box.flush()                                   # a drain already scheduled: no second wake-up
    assert len(loop.wakeups) == 1
    loop.wakeups.pop()()                          # the event loop drains
    assert [q.get_nowait() for _ in range(8) for q in queues[:1]] == list(range(0, 16, 2))
    assert [queues[1].get_nowait() for _ in range(8)] == list(range(1, 16, 2))
    box.flush()                                   # nothing posted since: nothing to wake for
    assert loop.wakeups == []


def test_scheduler_flushes_after_every_iteration_rests_the_pool_and_counts_its_time(small_model_dir):
    from engine.api import load
    from engine.serve import PrefixCache
    llm = load(str(small_model_dir), backend="auto")
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=4, cache=PrefixCache(max_entries=0))
    events, flushed_at = [], []
    sched.flush_hooks.append(lambda: flushed_at.append(len(events)))
    rests, rest = [], llm.step.rest
    llm.step.rest = lambda: (rests.append(len(events)), rest())   # the step's pool sleeps before delivery
    done = threading.Event()

    def emit(ev):
        events.append(ev)
        if isinstance(ev, Failure) or ev.finish_reason is not None:
            done.set()
    sched.start()
    try:
        sched.submit(Job(ids=[1, 5, 9], path="linear", params=SamplingParams(temperature=0), max_tokens=6,
                         ignore_eos=True, emit=emit))
        assert done.wait(30)
    finally:
        sched.stop()
    assert [type(ev) for ev in events] == [Token] * 6
    # one flush per iteration, after its tokens (the first admits the job and steps once: 2 tokens),
    # and one when the scheduler stops
    assert flushed_at == [2, 3, 4, 5, 6, 6]
    assert rests == [1, 2, 3, 4, 5]               # after every decode step, before its token goes out
    t = sched.stats()["timing"]
    assert t["tokens"] == 6 and t["iterations"] == 5
    assert 0 < t["step_cpu_s"] <= t["busy_cpu_s"] and 0 < t["step_s"] <= t["busy_s"]
    assert isinstance(sched.stats()["thread_id"], int)


class FakeServer:
    name = "m"
    fingerprint = "fp_test"

    def token_text(self, i):
        return f"<{i}>"

    def token_bytes(self, i):
        return self.token_text(i).encode()


class FakeRequest:
    logprobs = 0
    n = 1


async def _collect(queue, events, include_usage=False):
    job = Job(ids=[1, 2], path="linear", params=SamplingParams(), max_tokens=3, emit=None)
    fmt = CompletionFormat(FakeServer(), FakeRequest())
    for ev in events:
        queue.put_nowait(ev)
    return [chunk async for chunk in sse_stream(job, queue, fmt, include_usage)], job


def test_a_stream_sends_every_waiting_event_in_one_write():
    tokens = [Token(7, "a", None, -0.5), Token(8, " b", None, -1.0), Token(9, "c", "length", -2.0)]
    writes, job = asyncio.run(_collect(asyncio.Queue(), tokens))
    assert len(writes) == 1                       # three tokens and [DONE], already waiting: one write
    events = writes[0].split(b"\r\n\r\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    # the last token's text in a chunk of its own, then an empty one carrying finish_reason (as OpenAI)
    assert [c["choices"][0]["text"] for c in chunks] == ["a", " b", "c", ""]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks[:3]] == [["<7>"], ["<8>"], ["<9>"]]
    assert chunks[3]["choices"][0]["logprobs"] is None
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert job.cancelled                          # the stream's end releases the job


def test_a_failure_ends_the_stream_with_an_error_event_and_done():
    writes, _ = asyncio.run(_collect(asyncio.Queue(), [Token(7, "a", None, -0.5), Failure("boom")]))
    events = b"".join(writes).split(b"\r\n\r\n")
    err = json.loads(events[1][len(b"data: "):])["error"]
    assert err["message"] == "boom" and err["code"] == "internal_error"
    assert events[2:] == [b"data: [DONE]", b""]   # a client reading to [DONE] is not left waiting
    writes, _ = asyncio.run(_collect(asyncio.Queue(), [Failure("the server is shutting down", 503)]))
    events = b"".join(writes).split(b"\r\n\r\n")
    assert json.loads(events[0][len(b"data: "):])["error"]["code"] == "shutting_down"
    assert events[1:] == [b"data: [DONE]", b""]


def test_sse_framing_equals_sse_starlettes_event():
    obj = {"text": "line one\nline two \u00e9", "n": [1, 2.5, None]}
    assert sse(obj) == ServerSentEvent(data=json.dumps(obj)).encode()
