"""Who may talk to the server, and with how much: the HTTP guard in front of the app (ASGI middleware).

    policy = Policy(api_key="s3cret", allow_hosts=("localhost", "127.0.0.1", "::1"), max_body=4 << 20)
    app = create_app(server, policy)          # create_app(server): Policy()'s defaults

Refused, each with OpenAI's error body (engine.serve.errors), in this order:
- a Host header not on `allow_hosts` (400): DNS rebinding points a foreign name at 127.0.0.1, and a
  page on that name could then read the answers. Loopback names by default; "*" allows any,
  "*.example.com" a domain's names;
- OPTIONS when `cors_origins` is empty (405); with origins, Starlette's CORSMiddleware answers
  preflights as the CORS spec says;
- an Origin header that is neither on `cors_origins` nor the server's own (403): a web page the
  user visits may not drive the server;
- without `Authorization: Bearer <api_key>` when a key is set (401), on every route but /health
  (and the docs pages when they are on);
- a POST whose body is not `application/json` (415), to a route that takes POSTs (another path or
  method is the router's 404 / 405, and the connection closes after it): forms and text/plain are what a
  page can send without a preflight;
- a body over `max_body` bytes (413, connection closed): refused from its Content-Length before a
  byte is read, else as soon as the bytes received pass the limit (a chunked body is never buffered
  whole); the rest of the body is then read and thrown away for a bounded time before the close
  (engine.serve.connections' lingering close), so a client still writing it reads the 413, not a reset;
- a body whose next part does not arrive within `read_timeout` seconds, or that arrives slower than
  MIN_BODY_RATE bytes a second after its first `read_timeout` seconds (408, connection closed): a
  client that sends half a body, or one byte every few seconds, does not hold its handler and its
  connection forever (Apache's mod_reqtimeout rule: a deadline that grows with the bytes received).
The connection limit and the deadline on request headers are engine.serve.connections' (the
protocol's): they act before there is a request. HEAD on any GET route is answered as the GET, without
the body.
"""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from starlette.routing import Match

from engine.serve.errors import APIError
from engine.serve.page import PUBLIC_PATHS as PAGE

LOOPBACK = ("localhost", "127.0.0.1", "::1")
DEFAULT_MAX_BODY = 4 << 20     # bytes: a 4 MiB JSON body holds ~1M tokens of text
DEFAULT_MAX_CONNECTIONS = 512  # open connections (idle or not); batch rows and queue places are far fewer
DEFAULT_READ_TIMEOUT_S = 10.0  # seconds for a request's headers, and between the parts of its body
DEFAULT_KEEP_ALIVE_S = 5.0     # seconds an idle connection is kept between requests (uvicorn's default)
MIN_BODY_RATE = 500            # bytes a second a body must average past its first read_timeout seconds
PUBLIC = frozenset({"/health"}) | PAGE   # the page and its files hold no secret (engine.serve.page)
DOCS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class Policy:
    """The HTTP side's settings. api_key None: no key asked; allow_hosts: Host names answered (no
    port; "*" any); cors_origins: origins a browser page may call from (scheme://host[:port], "*"
    any), empty: CORS off; docs: serve /docs, /redoc and /openapi.json; max_body: bytes a request
    body may hold (0: no limit); max_connections: connections held at once (0: no limit; see
    engine.serve.connections); read_timeout: seconds a client has for a request's headers and
    between the parts of its body (0: none); keep_alive: seconds an idle connection is kept."""
    api_key: str | None = None
    allow_hosts: tuple[str, ...] = LOOPBACK
    cors_origins: tuple[str, ...] = ()
    docs: bool = False
    max_body: int = DEFAULT_MAX_BODY
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    keep_alive: float = DEFAULT_KEEP_ALIVE_S

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no key)")
        if self.max_body < 0:
            raise ValueError(f"max_body must be >= 0 (0 = no limit), got {self.max_body}")
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0 (0 = no limit), got {self.max_connections}")
        if not 0 <= self.read_timeout < float("inf"):
            raise ValueError(f"read_timeout must be a number of seconds >= 0 (0 = none), got {self.read_timeout}")
        if not 0 < self.keep_alive < float("inf"):
            raise ValueError(f"keep_alive must be a number of seconds > 0, got {self.keep_alive}")
        bad = [h for h in self.allow_hosts if not _name(h)]
        if bad:   # ("": every malformed Host would match it)
            raise ValueError(f"allow_hosts: {bad[0]!r} is not a host name (a name, name:port, *.domain or *)")
        object.__setattr__(self, "allow_hosts", tuple(_name(h) for h in self.allow_hosts))
        object.__setattr__(self, "cors_origins", tuple(o.rstrip("/") for o in self.cors_origins))

    def host_allowed(self, host: str | None) -> bool:
        if "*" in self.allow_hosts:
            return True
        if not host:
            return False
        name = _name(host)
        return bool(name) and any(name == h or (h.startswith("*.") and name.endswith(h[1:])) for h in self.allow_hosts)

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """A page's Origin may call: one of `cors_origins`, or the server's own (same origin)."""
        origin = origin.rstrip("/")
        if "*" in self.cors_origins or origin in self.cors_origins:
            return True
        scheme, sep, where = origin.partition("://")   # a page's own origin: http(s), this very Host
        return host is not None and bool(sep) and scheme.lower() in ("http", "https") and where.lower() == host.lower()


def _name(host: str) -> str:
    """A Host header's name: no port, no IPv6 brackets, no trailing dot, lower case. A bracketed value
    is an address only when nothing but a port follows it ("[::1]:8000"); anything else
    ("[::1].evil.example", "[::1"), a port that is not digits or a name holding "@", "/", "\\" or a space
    ("localhost:80@evil.example") is no name ("": no allowed name or domain matches it)."""
    host = host.strip().lower()
    if host.startswith("["):
        address, bracket, port = host[1:].partition("]")
        whole = bracket and (not port or (port[0] == ":" and port[1:].isdigit()))
        return address if whole else ""
    if host.count(":") == 1:
        host, port = host.split(":", 1)
        if not (port.isascii() and port.isdigit()):   # "localhost:80@evil.example": no port, so no name
            return ""
    return "" if any(c in host for c in "@/\\ ") else host.rstrip(".")


host_name = _name   # what --allow-host checks its names with


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _refuse(send, error: APIError, close: bool = False) -> None:
    response = error.response()
    if close:
        response.headers["connection"] = "close"
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class HostGuard:
    """Outermost: the Host allow-list, OPTIONS without CORS, foreign origins."""

    def __init__(self, app, policy: Policy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        host = headers.get("host")
        if not self.policy.host_allowed(host):
            return await _refuse(send, APIError(
                400, f"Host {host!r} is not served here; start the server with --allow-host NAME to answer it",
                param=None, code="host_not_allowed"))
        if scope["method"] == "OPTIONS" and not self.policy.cors_origins:
            return await _refuse(send, APIError(
                405, "OPTIONS is not allowed: CORS is off (start the server with --cors-origin ORIGIN)",
                code="method_not_allowed", headers={"Allow": "GET, POST"}))
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_allowed(origin, host):
            return await _refuse(send, APIError(
                403, f"Origin {origin!r} may not call this server; start it with --cors-origin {origin} "
                     "to allow that page", code="origin_not_allowed"))
        await self.app(scope, receive, send)


class RequestGuard:
    """Innermost (after CORS): the API key, the body's media type and its size."""

    def __init__(self, app, policy: Policy):
        self.app, self.policy = app, policy
        self.public = PUBLIC | (DOCS if policy.docs else frozenset())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        p, headers = self.policy, _headers(scope)
        if p.api_key is not None and scope["path"] not in self.public and not _key_matches(headers, p.api_key):
            return await _refuse(send, APIError(
                401, "Incorrect or missing API key: send the header `Authorization: Bearer <key>`",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        if scope["method"] == "HEAD":   # every GET route answers HEAD: its status and headers, no body
            return await self.app(dict(scope, method="GET"), receive, _headers_only(send))
        if scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        if not _routed(scope):   # no route takes it: the router's 404 / 405, and the connection closes after it
            return await self.app(scope, receive, _closing(send))   # (a body nobody reads may not trickle on)
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return await _refuse(send, APIError(
                415, f"The request body must be JSON (Content-Type: application/json), got {media or 'none'!r}",
                code="unsupported_media_type"), close=True)
        if not p.max_body and not p.read_timeout:
            return await self.app(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and p.max_body:
            if not declared.strip().isdigit():
                return await _refuse(send, APIError(400, f"Content-Length {declared!r} is not a number",
                                                    code="invalid_content_length"), close=True)
            if int(declared) > p.max_body:
                return await _refuse(send, too_large(p.max_body), close=True)
        await self._limited(scope, receive, send)

    async def _limited(self, scope, receive, send):
        limit, timeout, seen, started, whole = self.policy.max_body, self.policy.read_timeout or None, 0, False, False
        loop = asyncio.get_running_loop()
        begun = None   # when the app first asked for the body

        async def counted_receive():
            nonlocal seen, whole, begun
            if whole:   # the body is in: what follows is a wait for the client to go (no deadline)
                return await receive()
            wait = timeout
            if timeout is not None:
                begun = loop.time() if begun is None else begun
                left = begun + timeout + seen / MIN_BODY_RATE - loop.time()   # the deadline grows with the bytes
                wait = min(timeout, max(left, 0.05))   # (a part already here after a stalled loop is still taken)
            try:
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                if wait < timeout:
                    raise too_slow_rate(seen, loop.time() - begun) from None
                raise too_slow(timeout) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if limit and seen > limit:
                    raise too_large(limit)
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except APIError as e:   # a body over the limit read by code that let the error through
            if started or e.status not in (408, 413):
                raise
            await _refuse(send, e, close=True)


def _headers_only(send):
    """`send` for a HEAD request answered as its GET: the response's start (status, headers, the GET's
    Content-Length) as it is, its body empty (RFC 9110 9.3.2)."""
    async def head_send(message):
        if message["type"] == "http.response.body":
            message = {"type": "http.response.body", "body": b"", "more_body": message.get("more_body", False)}
        await send(message)
    return head_send


def _closing(send):
    """`send` whose response closes the connection (the rest of an unread body is drained for a bounded
    time: engine.serve.connections' lingering close), as the 413 and 415 refusals do."""
    async def closing_send(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = dict(message, headers=[*headers, (b"connection", b"close")])
        await send(message)
    return closing_send


def _routed(scope) -> bool:
    """Whether a route of the app takes this method at this path (a POST to a GET route is the router's
    405, not a 415 for its body)."""
    app = scope.get("app")
    routes = getattr(getattr(app, "router", None), "routes", None)
    if routes is None:   # not mounted in an app with a router: check every body
        return True
    return any(route.matches(scope)[0] == Match.FULL for route in routes)


def _key_matches(headers: dict, key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def too_large(limit: int) -> APIError:
    """413; the connection closes after it (the rest of the body is discarded, never buffered)."""
    return APIError(413, f"The request body is over this server's limit of {limit} bytes (--max-body)",
                    code="request_too_large", headers={"Connection": "close"})


def too_slow(timeout: float) -> APIError:
    """408; the connection closes after it."""
    return APIError(408, f"The request body stalled: no part of it arrived for {timeout:g} s (--read-timeout)",
                    code="request_timeout", headers={"Connection": "close"})


def too_slow_rate(seen: int, seconds: float) -> APIError:
    """408 for a body that trickles in (each part within --read-timeout, the whole too slow); closes."""
    return APIError(408, f"The request body arrives too slowly: {seen} bytes in {seconds:.0f} s (a body must "
                         f"average {MIN_BODY_RATE} bytes/s after its first --read-timeout seconds)",
                    code="request_timeout", headers={"Connection": "close"})


__all__ = ["Policy", "HostGuard", "RequestGuard", "LOOPBACK", "DEFAULT_MAX_BODY", "MIN_BODY_RATE", "too_large",
           "too_slow", "too_slow_rate"]
