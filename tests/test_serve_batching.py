"""gen serve under concurrency: batched requests equal their solo runs on both paths, joins mid-batch,
disconnects free their state, capacity gives 429, a failing step fails only its batch, the prefix cache."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_serve_support import NAME, LiveServer, chat_model_dir, client, make_server  # noqa: F401 (a fixture)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

PROMPTS = ["the cat sat", "once upon a time", "a little boy saw", "the dog ran home and",
           "she said hello", "he played ball in the park", "big", "the sun"]


@pytest.fixture(scope="module")
def live(small_model_dir):
    srv = LiveServer(make_server(small_model_dir, max_batch=8))
    yield srv
    srv.stop()


def spec(i: int) -> dict:
    """Request i of 8: its own prompt, length, seed; greedy for every third one."""
    return dict(prompt=PROMPTS[i], max_tokens=8 + 5 * i, temperature=0 if i % 3 == 0 else 0.9,
                seed=100 + i, top_k=0 if i % 2 else 20)


def run_stream(c, path: str, s: dict, started: threading.Event | None = None) -> tuple[str, str, list]:
    """Stream one completion; returns (text, finish_reason, chosen-token logprobs)."""
    own = {k: s[k] for k in ("top_k", "ignore_eos") if k in s}     # the engine's fields, outside OpenAI's
    body = {k: v for k, v in s.items() if k not in own}
    chunks = c.completions.create(model=NAME, stream=True, logprobs=0, extra_body={"attention": path, **own}, **body)
    text, reason, lps = "", None, []
    for ch in chunks:
        if started is not None:
            started.set()
        if ch.choices:
            text += ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
            if ch.choices[0].logprobs:
                lps += ch.choices[0].logprobs.tokens
    return text, reason, lps


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_eight_concurrent_streams_equal_their_solo_runs(live, path):
    c = client(live)
    solo = [run_stream(c, path, spec(i)) for i in range(8)]
    assert live.wait_idle()
    live.scheduler.peak_active = 0
    clients = [client(live) for _ in range(8)]   # made first: the requests start together
    sched = live.scheduler
    inner = sched.stepper
    sched.stepper = SlowSteps(inner)   # timing only: on a busy machine the short ones could end before the rest came
    try:
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda i: run_stream(clients[i], path, spec(i)), range(8)))
    finally:
        sched.stepper = inner
    assert live.scheduler.peak_active >= 4, "the requests never shared a decode step"
    for i, (a, b) in enumerate(zip(solo, together)):
        assert a == b, f"request {i} differs when batched:\n solo  {a}\n batch {b}"
    assert live.wait_idle()


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_a_request_joining_mid_batch_changes_nobody(live, path):
    c = client(live)
    long, short = dict(prompt="once upon a time", max_tokens=50, temperature=0.8, seed=7), \
        dict(prompt="the dog", max_tokens=20, temperature=0, seed=1)
    solo_long, solo_short = run_stream(c, path, long), run_stream(c, path, short)
    assert len(solo_long[2]) > 30
    live.scheduler.peak_active = 0
    started = threading.Event()
    sched = live.scheduler
    inner = sched.stepper
    sched.stepper = SlowSteps(inner)   # timing only: the long request is still decoding when the short one comes
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(run_stream, client(live), path, long, started)
            assert started.wait(30)
            second = pool.submit(run_stream, client(live), path, short)
            got_long, got_short = first.result(60), second.result(60)
    finally:
        sched.stepper = inner
    assert live.scheduler.peak_active == 2
    assert got_long == solo_long and got_short == solo_short


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_a_request_that_ends_at_its_first_token_is_no_failure(live, path):
    # found by benchmarks/serve_soak.py: with no stream running on its path, a request done at its first
    # token (max_tokens 1) joined an empty batch, which raised inside the loop: a 200 to the client, but
    # the server counted a failed decode step each time
    assert live.wait_idle()
    before = live.scheduler.failures
    out = client(live).completions.create(model=NAME, prompt="the cat", max_tokens=1, temperature=0,
                                          extra_body={"attention": path})
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert live.wait_idle()
    assert live.scheduler.failures == before


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_disconnect_mid_stream_frees_the_state_within_a_step(live, path):
    assert live.wait_idle()
    sched = live.scheduler
    inner = sched.stepper
    sched.stepper = SlowSteps(inner)   # timing only: the client leaves long before max_tokens
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 100000 if path == "linear" else 60,
            "stream": True, "attention": path, "temperature": 0.9, "ignore_eos": True}
    try:
        with httpx.Client(timeout=30) as h, h.stream("POST", live.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert sched.active == 1 and sched.states == 1
            steps_at_close = sched.steps
        assert live.wait_idle(10), f"state still held after the client left: {sched.stats()}"
        assert sched.steps - steps_at_close <= 5, "the sequence kept decoding after its client left"
    finally:
        sched.stepper = inner


def test_a_non_streaming_client_that_leaves_frees_its_row_while_tokens_flow(live):
    """A non-streaming request answers only at the end, so its tokens arrive for the whole run and the
    handler never waits long for one: the client must still be looked for (it was only when no token
    came for POLL_S, so a client gone with max_tokens 100000 held its batch row to the end)."""
    import socket
    assert live.wait_idle()
    sched = live.scheduler
    inner = sched.stepper
    sched.stepper = SlowSteps(inner)   # timing only: ~100 tokens a second, never a 0.25 s gap
    body = json.dumps({"model": NAME, "prompt": "the cat", "max_tokens": 100000, "attention": "linear",
                       "ignore_eos": True}).encode()
    steps_before = sched.steps
    try:
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 10
            while sched.steps < steps_before + 30 and time.monotonic() < deadline:   # decoding, tokens flowing
                time.sleep(0.02)
            assert sched.active == 1, sched.stats()
        # (to its max_tokens the row would decode 100000 tokens: over 15 minutes at SlowSteps' pace)
        assert live.wait_idle(10), f"the row is still held after the client left: {sched.stats()}"
    finally:
        sched.stepper = inner


def test_at_capacity_a_request_gets_429_with_retry_after(small_model_dir):
    live = LiveServer(make_server(small_model_dir, max_batch=1, max_queue=0, max_tokens_cap=0))   # a row held
    try:
        body = {"model": NAME, "prompt": "the cat", "max_tokens": 100000, "stream": True, "attention": "linear",
                "ignore_eos": True}
        with httpx.Client(timeout=30) as h, h.stream("POST", live.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()   # kept: a dropped iterator closes the connection
            first = next(lines)
            assert first.startswith("data: {")
            full = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
            assert full.status_code == 429, full.text
            assert int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["type"] == "rate_limit_error"
        assert live.wait_idle()
        ok = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    finally:
        live.stop()


class SlowSteps:
    """Wraps the scheduler's stepper: every one-token step takes 10 ms longer (timing only)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tokens, state, valid=None, last_only=False):
        if tokens.shape[1] == 1:
            time.sleep(0.01)
        return self.inner(tokens, state, valid=valid, last_only=last_only)


class FailingSteps:
    """Wraps the scheduler's stepper: one-token steps on `path` raise while armed."""

    def __init__(self, inner, path):
        self.inner, self.path, self.armed = inner, path, True

    def __call__(self, tokens, state, valid=None, last_only=False):
        if self.armed and tokens.shape[1] == 1 and state.path == self.path:
            raise RuntimeError("injected failure")
        if tokens.shape[1] == 1:
            time.sleep(0.01)   # timing only: the other path's request outlives the failures
        return self.inner(tokens, state, valid=valid, last_only=last_only)


def test_a_failing_step_fails_only_its_batch_and_the_server_keeps_serving(live):
    assert live.wait_idle()
    sched = live.scheduler
    inner = sched.stepper
    sched.stepper = FailingSteps(inner, "softmax")
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            linear = pool.submit(run_stream, client(live), "linear", dict(prompt="the cat", max_tokens=60, seed=3,
                                                                        ignore_eos=True),
                                 started)
            assert started.wait(30)
            with pytest.raises(openai.InternalServerError) as e:
                client(live).completions.create(model=NAME, prompt="the dog", max_tokens=10,
                                                extra_body={"attention": "softmax"})
            assert e.value.body["type"] == "server_error"
            body = {"model": NAME, "prompt": "a boy", "max_tokens": 10, "stream": True, "attention": "softmax"}
            raw = httpx.post(live.url + "/v1/completions", json=body, timeout=30).text
            assert '"error"' in raw and "injected failure" in raw
            assert not linear.done()
            text, reason, _ = linear.result(60)
        assert reason in ("stop", "length")   # the other path's batch was untouched
    finally:
        sched.stepper = inner
    ok = client(live).completions.create(model=NAME, prompt="the dog", max_tokens=5, extra_body={"attention": "softmax"})
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert live.wait_idle()


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_prefix_cache_hit_prefills_only_new_tokens_and_changes_nothing(chat_model_dir, path):
    cold = LiveServer(make_server(chat_model_dir, cache=False))
    warm = LiveServer(make_server(chat_model_dir, cache=True))
    try:
        first = [{"role": "user", "content": "the cat sat"}]
        second = first + [{"role": "assistant", "content": "on a mat"}, {"role": "user", "content": "and then"}]
        outs = {}
        for name, live in (("cold", cold), ("warm", warm)):
            c = client(live)
            for messages in (first, second):
                r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                              extra_body={"attention": path})
                outs.setdefault(name, []).append((r.choices[0].message.content, r.usage))
        assert [t for t, _ in outs["warm"]] == [t for t, _ in outs["cold"]]
        cached = outs["warm"][1][1].prompt_tokens_details.cached_tokens
        assert 0 < cached < outs["warm"][1][1].prompt_tokens
        assert outs["cold"][1][1].prompt_tokens_details.cached_tokens == 0
        stats = httpx.get(warm.url + "/stats").json()["prefix_cache"]
        assert stats["hits"] == 1 and stats["tokens_saved"] == cached
        assert stats["by_path"][path]["bytes"] > 0
    finally:
        cold.stop()
        warm.stop()


def test_stats_report_the_prefix_cache_bytes_per_path(small_model_dir):
    live = LiveServer(make_server(small_model_dir, cache=True))
    try:
        for path in ("softmax", "linear"):
            client(live).completions.create(model=NAME, prompt="the cat sat on a mat", max_tokens=2,
                                            extra_body={"attention": path})
        by_path = json.loads(httpx.get(live.url + "/stats").text)["prefix_cache"]["by_path"]
        assert set(by_path) == {"softmax", "linear"}
    finally:
        live.stop()


def test_an_error_in_the_loop_itself_fails_its_requests_and_the_loop_goes_on(live):
    assert live.wait_idle()
    sched = live.scheduler

    def broken(path):
        raise RuntimeError("a bug in the loop")
    sched._step = broken
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client(live).completions.create(model=NAME, prompt="the cat", max_tokens=5, extra_body={"ignore_eos": True})
        assert "a bug in the loop" in e.value.body["message"]
    finally:
        del sched._step
    assert sched.thread.is_alive()
    ok = client(live).completions.create(model=NAME, prompt="the cat", max_tokens=5)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert live.wait_idle()


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_prompts_arriving_together_are_prefilled_as_one_batch_and_equal_their_solo_runs(small_model_dir, path):
    """The scheduler driven by hand (no thread, no HTTP): six prompts of one length admitted in one
    iteration share one prefill step; each one's tokens equal its run alone."""
    from engine.api import load
    from engine.sampling import SamplingParams
    from engine.serve import PrefixCache, Scheduler
    from engine.serve.scheduler import Job, Token
    llm = load(str(small_model_dir), backend="auto")
    prompts = [[1, 10 + i, 20 + 2 * i, 30, 40 - i] for i in range(6)]

    def run(batch):
        sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=8, cache=PrefixCache(max_entries=0))
        prefills = []
        stepper = sched.stepper
        sched.stepper = lambda tokens, state, **kw: (prefills.append(tuple(tokens.shape)) if tokens.shape[1] > 1
                                                     else None) or stepper(tokens, state, **kw)
        outs = {}
        jobs = [Job(ids=p, path=path, params=SamplingParams(temperature=0.9 if i % 2 else 0, seed=i),
                    max_tokens=12, ignore_eos=True,
                    emit=lambda ev, i=i: outs.setdefault(i, []).append(ev.id if isinstance(ev, Token) else ev))
                for i, p in enumerate(prompts) if i in batch]
        sched._iterate(jobs)
        for _ in range(50):
            if not sched.active:
                break
            sched._iterate([])
        return outs, prefills

    together, prefills = run(range(6))
    assert prefills == [(6, 5)]
    for i in range(6):
        alone, _ = run([i])
        assert together[i] == alone[i], f"prompt {i}"


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_a_prompt_state_is_copied_once_into_the_batch_and_the_cache_keeps_it_unchanged(small_model_dir, path,
                                                                                       monkeypatch):
    """Issue 29's stall at a long prompt's end: the prefix cache keeps the prefilled state itself (no
    second copy of a 4k-token KV row) and a whole-prompt hit joins the cached state; decoding never
    writes to it, and the tokens stay those of the run without a cache."""
    from engine.api import load
    from engine.sampling import SamplingParams
    from engine.serve import PrefixCache, Scheduler
    from engine.serve.scheduler import Job, Token
    llm = load(str(small_model_dir), backend="auto")
    kind = type(llm.model.init_state(batch=1, max_len=4, attention=path))
    copies = []
    select_rows = kind.select_rows
    monkeypatch.setattr(kind, "select_rows", lambda self, *a, **kw: copies.append(1) or select_rows(self, *a, **kw))
    prompt = [1, 11, 22, 33, 44, 55, 66]

    def run(sched):
        out = []
        job = Job(ids=prompt, path=path, params=SamplingParams(temperature=0.9, seed=5), max_tokens=10,
                  ignore_eos=True, emit=lambda ev: out.append(ev.id if isinstance(ev, Token) else ev))
        sched._iterate([job])
        for _ in range(50):
            if not sched.active:
                break
            sched._iterate([])
        return out

    cold = run(Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=2, cache=PrefixCache(max_entries=0)))
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=2, cache=PrefixCache())
    copies.clear()
    first = run(sched)
    entry = sched.cache.entries[(path, tuple(prompt))]
    saved = [t.clone() for t in entry.state.tensors()]
    hit = run(sched)
    print(path, "select_rows calls:", len(copies), "hits:", sched.cache.hits)
    assert first == hit == cold and len(first) == 10
    assert sched.cache.hits == 1
    assert copies == [] and entry.state.max_len in (None, len(prompt))   # kept, not copied; no spare room
    assert all(torch.equal(a, b) for a, b in zip(saved, entry.state.tensors()))   # decoding never wrote to it
