"""The HTTP app (FastAPI): OpenAI's /v1/models, /v1/completions, /v1/chat/completions, plus /health
and /stats. Streaming answers are Server-Sent Events (sse-starlette) ending in `data: [DONE]`.

Bodies are parsed here (not by FastAPI's 422 machinery) so every bad request is a 400 with an
OpenAI-style error body; an unknown model is a 404, a full server a 429 with Retry-After, a
request that waited in the queue past the server's `queue_timeout` a 503 with Retry-After, a
failure inside the engine a 500 (in a stream, after the 200 has gone: an `error` event, then
`data: [DONE]`), a request a shutdown ends a 503 `shutting_down` (engine.serve.shutdown). Every
other error (unknown route 404, wrong method 405, body too large 413) has OpenAI's error body too.
A stream's 200 goes out with its first token, so a request that never got a row still gets a
status. A client that goes away cancels its job: a queued job leaves the queue at once, a running
one leaves before the next step.

Parsing a body and tokenizing its prompt run in a worker thread (Starlette's thread pool), not on
the event loop: a big prompt does not stall every other stream. Who may call at all (Host, Origin,
API key, media type, body size) is engine.serve.guard's business.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager

from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request    # what FastAPI hands a route (fastapi.Request is this class)
from starlette.responses import JSONResponse

from engine.serve.errors import APIError, bad_request, failure_error, queue_timeout, server_error
from engine.serve.guard import HostGuard, Policy, RequestGuard
from engine.serve.page import add_page
from engine.serve.row_stats import WithStats
from engine.serve.scheduler import Failure, Token
from engine.serve.schemas import ChatRequest, CompletionRequest, parse
from engine.serve.server import COMPLETION_DEFAULT_MAX_TOKENS, Server

POLL_S = 0.25     # a handler waiting for events checks for a vanished client this often
DONE = b"data: [DONE]\r\n\r\n"
MAX_DEPTH = 64    # JSON nesting a body may have (a chat request needs 4)


# what the official OpenAI SDKs add to every request (openai-node in a browser, dangerouslyAllowBrowser:
# x-stainless-os, -lang, -retry-count, -timeout, ..., and a User-Agent, which Firefox and Safari then
# preflight): a page on an allowed origin that uses one preflights them
SDK_HEADERS = re.compile(r"x-stainless-[a-z0-9-]+|openai-(?:organization|project|beta)|user-agent")


class JSONRefusingCORS(CORSMiddleware):
    """Starlette's CORS middleware, with a refused preflight (an origin, method or header not allowed)
    answered in OpenAI's error shape instead of plain text, and the OpenAI SDKs' own headers (SDK_HEADERS)
    allowed beside the configured ones; the rest is Starlette's, unchanged."""

    def preflight_response(self, request_headers):
        asked = [h.strip().lower() for h in request_headers.get("access-control-request-headers", "").split(",")]
        sdk = [h for h in asked if SDK_HEADERS.fullmatch(h)]
        if sdk:   # Starlette judges the others
            raw = [(k, v) for k, v in request_headers.raw if k != b"access-control-request-headers"]
            rest = [h for h in asked if h and h not in sdk]
            request_headers = Headers(raw=raw + ([(b"access-control-request-headers", ", ".join(rest).encode())]
                                                 if rest else []))
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            if sdk:
                response.headers["access-control-allow-headers"] = ", ".join(
                    [response.headers["access-control-allow-headers"], *sdk])
            return response
        reason = bytes(response.body).decode("utf-8", "replace").strip() or "CORS preflight refused"
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return APIError(response.status_code, f"{reason} (this server takes GET and POST with the headers "
                        "Authorization, Content-Type and the OpenAI SDKs' own, from the origins gen serve --cors-origin "
                        "names)",
                        code="cors_refused", headers=headers).response()


def create_app(server: Server, policy: Policy | None = None) -> "FastAPI":
    """The app serving `server`, behind `policy`'s guard (default: Policy(), loopback Hosts only, no
    key, no CORS, no docs, 4 MiB bodies)."""
    # FastAPI (with pydantic's machinery) takes ~250 ms to import: only `gen serve` pays for it, not
    # every `gen` command that imports the CLI.
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    policy = policy if policy is not None else Policy()

    @asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop(timeout=1.0)   # a shutdown's drain has stopped it already

    docs = {} if policy.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="gen", lifespan=lifespan, **docs)
    app.state.server = server
    app.state.policy = policy
    # the last added runs first: HostGuard, then CORS (answers preflights), then RequestGuard
    app.add_middleware(RequestGuard, policy=policy)
    if policy.cors_origins:
        app.add_middleware(JSONRefusingCORS, allow_origins=list(policy.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    app.add_middleware(HostGuard, policy=policy)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(HTTPException)   # the router's 404 and 405 (FastAPI's would be {"detail": ...})
    async def _http_error(request, exc: HTTPException):
        where = f"{request.method} {request.url.path}"
        message, code = {404: (f"Invalid URL ({where})", "unknown_url"),
                         405: (f"Method not allowed ({where})", "method_not_allowed")}.get(
                             exc.status_code, (f"{exc.detail} ({where})", None))
        return APIError(exc.status_code, message, code=code, headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return APIError(422, f"invalid request: {exc.errors()[0].get('msg', exc)}", code="invalid_value").response()

    @app.exception_handler(ClientDisconnect)   # the body stopped coming (a client gone, or a chunk h11
    async def _gone(request, exc: ClientDisconnect):   # refused: Connections.send_400_response): no one to answer
        return APIError(400, "the client went away before its request's body ended",
                        code="client_disconnected").response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):   # a bug: still an OpenAI-style body, and the server goes on
        # Starlette re-raises the exception after this answer and uvicorn then closes the connection:
        # `Connection: close` tells a keep-alive client so, or its next request on it is reset
        response = server_error(f"{type(exc).__name__}: {exc}").response()
        response.headers["connection"] = "close"
        return response

    add_page(app, server)   # the comparison page at / (engine.serve.page)

    @app.get("/health")   # (HEAD too, as every GET route: engine.serve.guard; monitors probe with it)
    async def health():
        if server.draining:   # a load balancer stops sending requests here
            return JSONResponse({"status": "shutting_down", "model": server.name}, status_code=503)
        return {"status": "ok", "model": server.name}

    @app.get("/stats")
    async def stats():
        return server.scheduler.stats()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "gen"}
                                           for name in server.names]}

    @app.get("/v1/models/{name:path}")   # a name may hold slashes: "org/model", a directory's path
    async def model(name: str):
        server.check_model(name)
        return {"id": name, "object": "model", "created": created, "owned_by": "gen"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, ids = await _prepare(request, CompletionRequest, server.completion_ids)
        return await _serve(request, req, ids, CompletionFormat(server, req), COMPLETION_DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req, ids = await _prepare(request, ChatRequest, server.chat_ids)
        return await _serve(request, req, ids, ChatFormat(server, req), None)

    async def _prepare(request: Request, cls, to_ids):
        """The body -> (request model, prompt ids), parsed and tokenized in a worker thread."""
        body = await request.body()

        def work():
            req = parse(cls, load_json(body))
            server.check_model(req.model)
            return req, to_ids(req)
        return await run_in_threadpool(work)

    mailboxes: dict = {}   # one per event loop (the app's; tests may run several servers)

    def _mailbox(loop) -> "Mailbox":
        box = mailboxes.get(loop)
        if box is None:
            box = mailboxes[loop] = Mailbox(loop)
            server.scheduler.flush_hooks.append(box.flush)
        return box

    async def _serve(request: Request, req, ids, fmt, default_max_tokens):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        mailbox = _mailbox(loop)
        job = server.make_job(req, ids, lambda ev: mailbox.post(queue, ev), default_max_tokens)
        fmt.fingerprint = server.fingerprint_for(job.spec)   # the request's own run (its attention options)
        if req.include_stats:
            fmt = WithStats(fmt, job, server)   # the `gen` field in every chunk; wraps job.emit
        server.submit(job)
        deadline = time.monotonic() + server.queue_timeout if server.queue_timeout else None
        try:
            events = await _wait(request, job, queue, deadline)   # the first token (or why there is none)
        except BaseException:
            job.cancel()
            raise
        if events is None:
            return JSONResponse({}, status_code=499)
        if isinstance(events[0], Failure):
            job.cancel()
            return failure_error(events[0]).response()
        if req.stream:
            return EventSourceResponse(sse_stream(job, queue, fmt, req.include_usage, events), ping=15)
        try:
            while events is not None:
                for ev in events:
                    if isinstance(ev, Failure):
                        return failure_error(ev).response()
                    fmt.add(ev)
                    if fmt.finished:   # every choice
                        return fmt.whole(usage(job))
                events = await _wait(request, job, queue)
            return JSONResponse({}, status_code=499)
        finally:
            job.cancel()

    async def _wait(request: Request, job, queue: asyncio.Queue, deadline: float | None = None):
        """`job`'s next events; None once the client has gone (the job is cancelled: a queued job leaves
        the queue at once). The client is looked for every POLL_S, whether or not tokens arrive meanwhile
        (a non-streaming request's tokens can arrive for minutes: a client that left must not hold its
        batch row until max_tokens). Past `deadline` (time.monotonic) a job still in the queue is
        withdrawn: 503."""
        while True:
            timeout = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            try:
                events = await _pending(queue, timeout)
            except asyncio.TimeoutError:
                events = None
            now = time.monotonic()
            if events is None or now >= getattr(request.state, "gen_look_at", 0.0):
                request.state.gen_look_at = now + POLL_S
                if await request.is_disconnected():
                    job.cancel()
                    return None
            if events is not None:
                return events
            if deadline is not None and now >= deadline:
                if server.scheduler.withdraw(job):
                    raise queue_timeout(server.queue_timeout, server.retry_after) from None
                deadline = None   # admitted meanwhile: it runs

    return app


class Mailbox:
    """Events from the scheduler's thread to the event loop's queues. `post` only appends; the
    scheduler calls `flush` once an iteration's tokens are all emitted, which wakes the loop once
    for all of them (call_soon_threadsafe: a lock, a self-pipe write, a loop iteration). Waking on
    the first token of a step instead woke the loop while the decode thread still had the step's
    other tokens to deliver: the two threads then took turns on the GIL, token by token. Order is
    kept (one list, drained in order)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    def post(self, queue: asyncio.Queue, event) -> None:
        with self.lock:
            self.items.append((queue, event))

    def flush(self) -> None:
        with self.lock:
            if self.scheduled or not self.items:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, event in items:
            queue.put_nowait(event)


async def _pending(queue: asyncio.Queue, timeout: float | None = None) -> list:
    """The next event and every one already queued behind it (waits up to `timeout` for the first)."""
    first = await (queue.get() if timeout is None else asyncio.wait_for(queue.get(), timeout))
    events = [first]
    while not queue.empty():
        events.append(queue.get_nowait())
    return events


async def sse_stream(job, queue: asyncio.Queue, fmt, include_usage: bool, first: list | None = None):
    """A streaming response's body: SSE events (bytes) for `job`'s tokens (`first`, those already
    taken from the queue, then those reaching `queue`), then the usage chunk (when asked) and
    `data: [DONE]`; a Failure ends it with an `error` event and `data: [DONE]`. Every event already
    waiting goes out in one write (one ASGI send): a client whose reader fell behind the decode loop
    catches up in one send, not one per token."""
    try:
        opening = [sse(chunk) for chunk in fmt.opening()]
        if opening:
            yield b"".join(opening)
        done = False
        while not done:
            out, events, first = [], first or await _pending(queue), None
            for ev in events:
                if isinstance(ev, Failure):
                    out += [sse(failure_error(ev).body()), DONE]
                    yield b"".join(out)
                    return
                out += [sse(chunk) for chunk in fmt.chunks(ev)]
                if fmt.finished:   # every choice
                    done = True
                    break
            if done:
                if include_usage:
                    out.append(sse(fmt.usage_chunk(usage(job))))
                out.append(DONE)
            if out:
                yield b"".join(out)
    finally:
        job.cancel()   # a client gone mid-stream (the task is cancelled here) frees its row


def sse(obj) -> bytes:
    """One Server-Sent Event carrying `obj` as JSON (what sse-starlette's ServerSentEvent(data=...)
    encodes: json.dumps escapes newlines, so the data is one line)."""
    return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"


def load_json(body: bytes):
    """A request body -> its JSON value, or a 400: not JSON (an integer literal past Python's 4300 digits
    included), nested deeper than MAX_DEPTH, or a string that is not valid Unicode (a lone surrogate
    such as "\\ud800": no tokenizer can encode it)."""
    try:
        text = body.decode("utf-8-sig")   # strict: a surrogate's bytes (ED A0 80) are not UTF-8 (json.loads of
    except UnicodeDecodeError as e:       # the bytes would pass them: it decodes with surrogatepass)
        raise bad_request(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start}): send UTF-8 text",
                          None, "invalid_unicode") from None
    try:
        value = json.loads(text)
    except ValueError as e:   # JSONDecodeError, an integer of over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:
        depth = MAX_DEPTH + 1
    else:   # the walk only where it can find something (C-speed scans: a 4 MiB list of ids is not walked)
        escaped = b"\\ud" in body or b"\\uD" in body
        depth = _check_strings(value) if escaped or body.count(b"[") + body.count(b"{") > MAX_DEPTH else 0
    if depth > MAX_DEPTH:
        raise bad_request(f"the request body is nested deeper than {MAX_DEPTH} levels", None, "invalid_json")
    return value


def _check_strings(value) -> int:
    """Walks a JSON value (iteratively): its depth (stops past MAX_DEPTH); a 400 at a string (key or
    value) holding a lone surrogate."""
    todo, deepest = [(value, 1)], 0
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        if isinstance(v, str):
            strings = (v,)
        elif isinstance(v, dict):
            strings = tuple(v)
            todo.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            strings = ()
            todo.extend((x, d + 1) for x in v)
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(f"the request body holds invalid Unicode ({e.reason} at character {e.start} of "
                                  "a string): send UTF-8 text", None, "invalid_unicode") from None
    return deepest


def usage(job) -> dict:
    """OpenAI's usage of a request: its prompt once, the tokens of every choice."""
    p, c = len(job.ids), sum(len(j.generated) for j in job.group)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}


class Choice:
    """One choice's text so far, finish reason, and the format's running logprobs state."""

    def __init__(self):
        self.text, self.reason, self.logprobs = "", None, None
        # completions' text_offset: the characters of the tokens so far (an incomplete one held back)
        self.chars, self.utf8 = 0, codecs.getincrementaldecoder("utf-8")("replace")


class _Format:
    """What both endpoints' objects share: each choice's text so far and finish reason (a request
    has `n` choices; a Token's index says whose it is), and a stream's chunks as OpenAI sends them:
    a token's text (and logprobs) in a chunk of its own, then, when it is the choice's last, a chunk
    with no text carrying the finish_reason (clients that stop at finish_reason lose no token).
    Subclasses say what a token's logprobs look like (`_piece`), how the whole response keeps them
    (`_keep`) and how one chunk reads (`_chunk`)."""

    prefix = ""

    def __init__(self, server: Server, req):
        self.server, self.req = server, req
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())
        self.fingerprint = server.fingerprint   # _serve sets the request's own
        self.choices = [self._choice() for _ in range(req.n)]

    def _choice(self) -> Choice:
        return Choice()

    @property
    def finished(self) -> bool:
        return all(c.reason is not None for c in self.choices)

    def add(self, ev: Token) -> None:
        c = self.choices[ev.index]
        piece = self._piece(ev, c)
        if piece is not None:
            self._keep(c, piece)
        c.text += ev.text
        c.reason = ev.finish_reason or c.reason

    def chunks(self, ev: Token) -> list:
        """The stream chunks of one event: none, its text, its finish, or both (in that order)."""
        c = self.choices[ev.index]
        piece = self._piece(ev, c)
        out = [self._chunk(ev.index, ev.text, piece, None)] if ev.text or piece is not None else []
        if ev.finish_reason is not None:
            c.reason = ev.finish_reason
            out.append(self._chunk(ev.index, "", None, ev.finish_reason))
        return out

    def _object(self, obj: str, choices: list, usage=None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.name,
                "system_fingerprint": self.fingerprint, "choices": choices, "usage": usage}


class CompletionFormat(_Format):
    """/v1/completions objects ("text_completion"); logprobs in the legacy layout."""

    prefix = "cmpl"

    def _choice(self) -> Choice:
        c = Choice()
        if self.req.logprobs is not None:
            c.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return c

    def _base(self, choices, usage=None) -> dict:
        return self._object("text_completion", choices, usage)

    def _piece(self, ev: Token, c: Choice) -> dict | None:
        if ev.logprob is None:
            return None
        tt = self.server.token_text
        top = {tt(i): lp for i, lp in (ev.top or [])}
        top.setdefault(tt(ev.id), ev.logprob)   # as OpenAI and vLLM: the sampled token too (up to logprobs + 1)
        # text_offset: where the token's text starts in the choice's text, counted from the tokens
        # themselves (the text released so far lags while a stop string may be starting); a token that
        # ends a character begun by the one before points at that character
        out = {"tokens": [tt(ev.id)], "token_logprobs": [ev.logprob], "top_logprobs": [top], "text_offset": [c.chars]}
        c.chars += len(c.utf8.decode(self.server.token_bytes(ev.id)))
        return out

    def _keep(self, c: Choice, piece: dict) -> None:
        for k in c.logprobs:
            c.logprobs[k] += piece[k]

    def _chunk(self, index: int, text: str, piece, reason):
        return self._base([{"index": index, "text": text, "logprobs": piece, "finish_reason": reason}])

    def opening(self):
        return []

    def whole(self, usage: dict) -> dict:
        return self._base([{"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.reason}
                           for i, c in enumerate(self.choices)], usage)

    def usage_chunk(self, usage: dict) -> dict:
        return self._base([], usage)


class ChatFormat(_Format):
    """/v1/chat/completions objects ("chat.completion", "chat.completion.chunk")."""

    prefix = "chatcmpl"

    def _choice(self) -> Choice:
        c = Choice()
        if self.req.logprobs:
            c.logprobs = []
        return c

    def _piece(self, ev: Token, c: Choice) -> dict | None:
        if ev.logprob is None:
            return None
        tt, tb = self.server.token_text, self.server.token_bytes

        def one(i, lp):
            return {"token": tt(i), "logprob": lp, "bytes": list(tb(i))}
        return dict(one(ev.id, ev.logprob), top_logprobs=[one(i, lp) for i, lp in (ev.top or [])])

    def _keep(self, c: Choice, piece: dict) -> None:
        c.logprobs.append(piece)

    def _chunk(self, index: int, text: str, entry, reason):
        delta = {"content": text} if text else {}
        return self._object("chat.completion.chunk", [{
            "index": index, "delta": delta, "logprobs": {"content": [entry]} if entry else None,
            "finish_reason": reason}])

    def opening(self):
        return [self._object("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}])
                for i in range(len(self.choices))]

    def whole(self, usage: dict) -> dict:
        return self._object("chat.completion", [{
            "index": i, "message": {"role": "assistant", "content": c.text},
            "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
            "finish_reason": c.reason} for i, c in enumerate(self.choices)], usage)

    def usage_chunk(self, usage: dict) -> dict:
        return self._object("chat.completion.chunk", [], usage)
