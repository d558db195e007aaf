"""The server's limits: sampling never returns garbage (extreme but valid settings, degenerate logits),
prompt and body sizes, the queue (clients that gave up leave it, a wait has a timeout), and the
CLI's checks of its limit flags. Servers run in-process on 127.0.0.1 (tests/test_serve_support.py)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.api import load
from engine.errors import InvalidArgumentError
from engine.sampling import FP32, Sampler, SamplingParams, filtered_logits
from engine.serve.batch_sampling import RowSampler, sample_rows
from engine.serve.guard import Policy, RequestGuard
from engine.serve.scheduler import Full

V = 50


def logits_batch(B=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


def both_samplers(params: SamplingParams, logits: torch.Tensor, prompt=(1, 2, 3)) -> list[list[int]]:
    """The tokens engine.sampling.Sampler (the API's) and the server's sample_rows draw from `logits`."""
    api = Sampler(params, logits.shape[0], V)
    api.observe(torch.tensor([list(prompt)] * logits.shape[0]))
    rows = [RowSampler(params, list(prompt), V) for _ in range(logits.shape[0])]
    return [api.sample(logits).tolist(), sample_rows(rows, logits)]


# ---------------------------------------------------------------------- sampling never returns garbage
UNDERFLOW = {   # settings whose arithmetic underflows in float32: each one acts as its limit
    "top_p=1e-46": SamplingParams(temperature=1.0, top_p=1e-46, seed=1),            # 0 in fp32: top-1
    "top_p=1e-46-T0.5": SamplingParams(temperature=0.5, top_p=1e-46, seed=2),
    "top_p=min-subnormal": SamplingParams(temperature=1.0, top_p=1.4e-45, seed=3),
}


@pytest.mark.parametrize("name", list(UNDERFLOW))
def test_a_top_p_that_underflows_keeps_the_most_likely_token(name):
    x = logits_batch()
    f = filtered_logits(x, UNDERFLOW[name])
    assert torch.isfinite(f).sum(-1).tolist() == [1] * 4          # the nucleus is the top token, never empty
    for tokens in both_samplers(UNDERFLOW[name], x):
        print(name, tokens, x.argmax(-1).tolist())
        assert tokens == x.argmax(-1).tolist()


def test_a_min_p_that_underflows_keeps_every_token():
    x = logits_batch()
    assert torch.isfinite(filtered_logits(x, SamplingParams(min_p=1e-46))).all()


@pytest.mark.parametrize("penalty", [1e-300, 1e-39, 1e39, 1e300], ids=lambda p: f"{p:g}")
def test_a_repetition_penalty_outside_float32_is_refused(penalty):
    with pytest.raises(InvalidArgumentError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)


def test_the_extreme_penalties_float32_holds_are_accepted_and_sample_a_seen_or_the_best_token():
    x = logits_batch()
    for penalty in (FP32.tiny, FP32.max):
        p = SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=4)
        for tokens in both_samplers(p, x, prompt=(1, 2, 3)):
            print(penalty, tokens)
            assert all(0 <= t < V for t in tokens)
            if penalty < 1:   # seen positive logits scaled past float32: the draw is one of them
                assert all(t in (1, 2, 3) for b, t in enumerate(tokens) if (x[b, [1, 2, 3]] > 0).any())


def degenerate_logits() -> torch.Tensor:
    """Rows a model or a filter can hand the sampler: a NaN, a +inf, nothing but -inf, all NaN."""
    x = logits_batch(B=5, seed=3)
    x[0, 7] = float("nan")
    x[1, 11] = float("inf")
    x[2] = float("-inf")
    x[3] = float("nan")
    return x


DEGENERATE = {"plain": SamplingParams(temperature=1.0, seed=5),
              "filters": SamplingParams(temperature=0.7, seed=6, top_k=5, top_p=0.9, min_p=0.01),
              "penalty": SamplingParams(temperature=1.0, seed=7, repetition_penalty=1.3),
              "greedy": SamplingParams(temperature=0)}


@pytest.mark.parametrize("name", list(DEGENERATE))
def test_no_row_is_sampled_from_nan_or_all_zero_probabilities(name):
    """A row softmax cannot make a distribution of takes its greedy token (NaN counted as -inf); the
    old draw landed on the last vocabulary id (its CDF was NaN) or raised (torch.multinomial)."""
    x = degenerate_logits()
    clean = torch.where(torch.isnan(x), float("-inf"), x)
    for tokens in both_samplers(DEGENERATE[name], x, prompt=(40, 41)):
        print(name, tokens)
        assert tokens[0] == clean[0].argmax().item()     # a NaN in the row: never the NaN's id
        assert tokens[1] == 11                           # a +inf: the distribution's limit, all mass there
        assert tokens[2] == tokens[3] == 0               # nothing to choose from: the first id, not the last
        assert 0 <= tokens[4] < V


# ---------------------------------------------------------------------- through the server
httpx = pytest.importorskip("httpx")
from test_serve_support import NAME, LiveServer, make_server   # noqa: E402

GOOD = {"model": NAME, "prompt": "the cat", "max_tokens": 4, "temperature": 0}


def post(live, body=None, timeout=30, **kw):
    return httpx.post(live.url + "/v1/completions", json=dict(GOOD, **kw) if body is None else body, timeout=timeout)


def error_of(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.fixture(scope="module")
def live(small_model_dir):
    srv = LiveServer(make_server(small_model_dir, max_prompt=20))
    yield srv
    srv.stop()


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_extreme_sampling_settings_through_the_server(live, path):
    greedy = post(live, temperature=0, attention=path, max_tokens=8, ignore_eos=True).json()["choices"][0]["text"]
    tiny_p = post(live, temperature=1.0, top_p=1e-46, seed=3, attention=path, max_tokens=8, ignore_eos=True)
    assert tiny_p.status_code == 200 and tiny_p.json()["choices"][0]["text"] == greedy
    err = error_of(post(live, repetition_penalty=1e-300, attention=path), 400)
    assert err["param"] == "repetition_penalty" and "float32" in err["message"]


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_max_prompt_holds_on_both_paths(live, path):
    ids = list(range(1, 22))   # 21 tokens: one over the server's max_prompt
    err = error_of(post(live, prompt=ids, attention=path), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and "--max-prompt" in err["message"]
    assert post(live, prompt=ids[:20], attention=path, max_tokens=2).status_code == 200


def test_max_prompt_defaults_to_the_context_and_zero_is_no_limit(small_model_dir):
    server = make_server(small_model_dir)
    assert server.max_prompt == server.max_context == 64
    long = list(range(1, 101))   # over the context: the linear path took it whole before
    srv = LiveServer(server)
    try:
        assert error_of(post(srv, prompt=long, attention="linear"), 400)["code"] == "context_length_exceeded"
    finally:
        srv.stop()
    srv = LiveServer(make_server(small_model_dir, max_prompt=0))
    try:
        assert post(srv, prompt=long, attention="linear", max_tokens=2).status_code == 200
    finally:
        srv.stop()


def test_max_tokens_is_capped_on_every_path(small_model_dir):
    """--max-tokens-cap clamps max_tokens (finish_reason "length"); by default a linear request, which
    nothing else bounds, is capped at DEFAULT_LINEAR_MAX_TOKENS_CAP, a softmax one by its context."""
    from engine.serve.schemas import CompletionRequest, parse
    from engine.serve.server import DEFAULT_LINEAR_MAX_TOKENS_CAP
    server = make_server(small_model_dir)

    def job(path, **kw):
        req = parse(CompletionRequest, dict(GOOD, prompt=[1, 2, 3], attention=path, **kw))
        return server.make_job(req, [1, 2, 3], print, None)
    assert job("linear", max_tokens=10 ** 12).max_tokens == DEFAULT_LINEAR_MAX_TOKENS_CAP
    assert job("softmax", max_tokens=10 ** 12).max_tokens == server.max_context - 3
    assert job("linear", max_tokens=7).max_tokens == 7
    server.max_tokens_cap = 0   # no cap: the linear request gets what it asks
    assert job("linear", max_tokens=10 ** 12).max_tokens == 10 ** 12
    srv = LiveServer(make_server(small_model_dir, max_tokens_cap=5))
    try:
        for path in ("linear", "softmax"):
            r = post(srv, attention=path, max_tokens=10 ** 12, ignore_eos=True).json()
            assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
    finally:
        srv.stop()


def test_prompts_are_tokenized_off_the_event_loop(live):
    """The body is parsed and the prompt tokenized in a worker thread: a big prompt does not stall the
    loop every stream is served from."""
    seen = []
    inner = live.server.completion_ids
    live.server.completion_ids = lambda req: (seen.append(threading.get_ident()), inner(req))[1]
    try:
        assert post(live).status_code == 200
    finally:
        del live.server.completion_ids
    print("loop thread", live.thread.ident, "tokenized in", seen)
    assert seen and seen[0] != live.thread.ident


# ---------------------------------------------------------------------- the body size limit
def raw_request(live, head: bytes, body: bytes = b"") -> bytes:
    """Sends one request over a socket; returns what the server answered (until it closes, 10 s at most)."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        s.sendall(head + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_declared_body_over_max_body_is_refused_before_it_is_read(small_model_dir):
    srv = LiveServer(make_server(small_model_dir), Policy(max_body=1000))
    try:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 * 2 ** 20}\r\n\r\n").encode()
        answer = raw_request(srv, head, b'{"model": ')   # 100 MB announced, 10 bytes sent: answered, closed
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 413"), answer
        err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "request_too_large" and "1000 bytes" in err["message"]
        big = dict(GOOD, prompt="word " * 400)      # 2 KB of JSON through a client
        assert error_of(post(srv, big), 413)["code"] == "request_too_large"
        assert post(srv, GOOD).status_code == 200
    finally:
        srv.stop()


def test_a_chunked_body_is_refused_as_soon_as_it_passes_max_body():
    """No Content-Length (chunked upload of 100 MB): the guard stops at the first receive past the
    limit; the body is never read whole."""
    policy = Policy(max_body=4 << 20)
    reads, sent = [0], []

    async def app(scope, receive, send):   # reads the whole body, as request.body() does
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        reads[0] += 1
        return {"type": "http.request", "body": b"x" * 2 ** 20, "more_body": reads[0] < 100}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]}
    asyncio.run(RequestGuard(app, policy)(scope, receive, send))
    print("MiB read", reads[0])
    assert sent[0]["status"] == 413 and reads[0] == 5   # 5 MiB read: the first past 4 MiB
    assert (b"connection", b"close") in sent[0]["headers"]


# ---------------------------------------------------------------------- connections
def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent on `sock` before closing it, or None if it is still open after `seconds`."""
    sock.settimeout(seconds)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except socket.timeout:
        return None
    except ConnectionResetError:
        pass
    return out


def test_silent_and_half_sent_connections_are_closed_and_the_server_keeps_answering(small_model_dir):
    """Connections that send nothing, half a request's headers, or its headers a byte at a time are
    closed after --read-timeout; one over --max-connections gets a 503 at once; then /health answers."""
    srv = LiveServer(make_server(small_model_dir), Policy(max_connections=12, read_timeout=0.5))
    socks = []
    try:
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(8)]
        for s in socks[4:]:   # half a request's headers
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        drip = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        socks.append(drip)
        time.sleep(0.2)       # the server has taken them all in
        extra = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(6)]
        socks += extra
        answers = [closed_within(s, 5) for s in extra[3:]]   # 13th..15th: over the limit of 12
        assert all(a is not None and a.startswith(b"HTTP/1.1 503") for a in answers), answers
        assert json.loads(answers[0].partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        t0, sent = time.monotonic(), 0
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n":   # slowloris: a byte every 50 ms
            try:
                drip.sendall(bytes([byte]))
            except OSError:
                break
            sent += 1
            time.sleep(0.05)
        assert closed_within(drip, 5) is not None and time.monotonic() - t0 < 3, sent   # the deadline ran from byte 1
        for s in socks[:8] + extra[:3]:
            assert closed_within(s, 5) is not None     # closed by the server, nothing answered
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_a_stalled_body_gets_408_and_idle_connections_close(small_model_dir):
    srv = LiveServer(make_server(small_model_dir), Policy(read_timeout=0.5, keep_alive=0.5))
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\": ")   # 10 of 100 bytes, then nothing
            answer = closed_within(s, 5)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:   # keep-alive, then idle
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = closed_within(s, 5)
        assert answer is not None and b" 200 " in answer.split(b"\r\n")[0]
        assert post(srv, GOOD).status_code == 200
    finally:
        srv.stop()


def test_a_body_that_trickles_in_gets_408_though_no_gap_reaches_the_timeout(small_model_dir):
    """A byte every 0.3 s never stalls for --read-timeout (1 s) but would hold its connection for as long as
    the client liked (512 such held every other client off); past its first second a body must average
    MIN_BODY_RATE bytes a second."""
    from engine.serve.guard import MIN_BODY_RATE
    srv = LiveServer(make_server(small_model_dir), Policy(read_timeout=1.0))
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            s.settimeout(0.3)
            start, answer = time.monotonic(), b""
            while time.monotonic() - start < 8 and not answer:
                try:
                    s.sendall(b" ")
                    answer = s.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    break
        assert answer.startswith(b"HTTP/1.1 408"), answer
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and f"average {MIN_BODY_RATE} bytes/s" in error["message"]
        assert post(srv, GOOD).status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("head", [b"POST /v1/nothing", b"POST /health"])
def test_a_body_to_a_route_that_takes_no_post_cannot_trickle_on(small_model_dir, head):
    """A POST no route takes gets the router's 404 / 405 at once, then its connection closes (the rest of
    its body drained for LINGER_S at most): a byte every 0.3 s held it open for as long as the client liked."""
    from engine.serve.connections import LINGER_S
    srv = LiveServer(make_server(small_model_dir), Policy(read_timeout=1.0))
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(head + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                      b"Content-Length: 100000\r\n\r\nx")
            s.settimeout(0.3)
            start, answer, closed = time.monotonic(), b"", False
            while time.monotonic() - start < LINGER_S + 4 and not closed:
                try:
                    s.sendall(b"x")
                    chunk = s.recv(65536)
                    answer += chunk
                    closed = chunk == b""
                except socket.timeout:
                    continue
                except OSError:   # reset: closed
                    closed = True
        assert closed and answer.split(b"\r\n")[0] in (b"HTTP/1.1 404 Not Found", b"HTTP/1.1 405 Method Not Allowed"), answer
    finally:
        srv.stop()


# ---------------------------------------------------------------------- the queue
@contextlib.contextmanager
def row_held(live):
    """A stream that holds the server's only row while the block runs (linear, ignore_eos, a huge
    max_tokens: the server needs max_tokens_cap=0); closed after it."""
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 10 ** 6, "stream": True, "attention": "linear",
            "ignore_eos": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", live.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()                  # kept alive: a dropped iterator closes the stream
        assert next(lines).startswith("data: {")
        yield lines


def queued(live) -> int:
    return httpx.get(live.url + "/stats").json()["queued"]


def wait_for(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_clients_that_gave_up_while_queued_leave_the_queue_at_once(small_model_dir):
    """N clients time out while queued (streaming and not): the queue is empty again and the next
    request is queued, not refused with 429 (before, every gone client kept its place)."""
    n = 4
    srv = LiveServer(make_server(small_model_dir, max_batch=1, max_queue=n, queue_timeout=1.0,
                                  max_tokens_cap=0))
    try:
        with row_held(srv):
            def give_up(i):
                with pytest.raises(httpx.ReadTimeout):
                    if i % 2:
                        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(GOOD, stream=True),
                                          timeout=0.5) as r:
                            r.read()
                    else:
                        post(srv, timeout=0.5)
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(give_up, range(n)))
            assert wait_for(lambda: queued(srv) == 0), srv.scheduler.stats()
            r = post(srv)   # admitted to the queue (not 429), where it waits its queue_timeout out
            err = error_of(r, 503)
            assert err["code"] == "queue_timeout" and int(r.headers["retry-after"]) >= 1
            assert queued(srv) == 0
        assert srv.wait_idle()
        assert post(srv).status_code == 200
    finally:
        srv.stop()


def test_queued_requests_time_out_with_503_and_retry_after(small_model_dir):
    """N queued requests wait past queue_timeout: each gets 503 with Retry-After, the queue is empty,
    and once the row frees a new request is served."""
    n = 3
    srv = LiveServer(make_server(small_model_dir, max_batch=1, max_queue=n, queue_timeout=0.5,
                                  max_tokens_cap=0))
    try:
        with row_held(srv):
            with ThreadPoolExecutor(n) as pool:
                answers = list(pool.map(lambda i: post(srv, stream=bool(i % 2)), range(n)))
            for r in answers:
                assert error_of(r, 503)["code"] == "queue_timeout" and r.headers["retry-after"] == "1"
            assert queued(srv) == 0
        assert srv.wait_idle()
        assert post(srv).status_code == 200
    finally:
        srv.stop()


def test_a_job_cancelled_in_the_queue_leaves_it_at_once(small_model_dir):
    from engine.serve.scheduler import Job, Scheduler
    llm = load(str(small_model_dir))
    sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=1, max_queue=2)   # not started: jobs stay queued
    jobs = [Job(ids=[1, 2], path="linear", params=SamplingParams(temperature=0), max_tokens=2, emit=print)
            for _ in range(3)]
    for job in jobs:
        sched.submit(job)
    with pytest.raises(Full):
        sched.submit(Job(ids=[1], path="linear", params=SamplingParams(), max_tokens=1, emit=print))
    jobs[1].cancel()
    assert list(sched.pending) == [jobs[0], jobs[2]]
    assert sched.withdraw(jobs[0]) and not sched.withdraw(jobs[0])
    sched.submit(Job(ids=[1], path="linear", params=SamplingParams(), max_tokens=1, emit=print))
    assert len(sched.pending) == 2


# ---------------------------------------------------------------------- the CLI's limit flags
@pytest.mark.parametrize("args,what", [(["--max-queue", "-1"], "--max-queue"), (["--max-prompt", "-1"], "--max-prompt"),
                                       (["--queue-timeout", "-1"], "--queue-timeout"),
                                       (["--queue-timeout", "nan"], "--queue-timeout"),
                                       (["--max-body", "-5"], "--max-body"),
                                       (["--max-tokens-cap", "-1"], "--max-tokens-cap"),
                                       (["--max-connections", "-1"], "--max-connections"),
                                       (["--read-timeout", "inf"], "--read-timeout"),
                                       (["--timeout-keep-alive", "0"], "--timeout-keep-alive"),
                                       (["--served-model-name", " "], "--served-model-name"),
                                       (["--shutdown-grace", "-1"], "--shutdown-grace"),
                                       (["--api-key", " "], "--api-key"),
                                       (["--allow-host", ""], "--allow-host"),
                                       (["--prefill-share", "-1"], "--prefill-share"),
                                       (["--prefill-share", "nan"], "--prefill-share")],
                         ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_gen_serve_refuses_bad_limits_in_one_line(args, what):
    from click.testing import CliRunner

    from cli.main import main
    r = CliRunner().invoke(main, ["serve", *args])
    assert r.exit_code == 2, r.output
    assert what in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
