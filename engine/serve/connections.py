"""Connections: how many the server holds, and how long a client may take to send a request.

    config = uvicorn_config(app, policy, host="127.0.0.1", port=8000)   # uvicorn.Server(config).run()

uvicorn's own HTTP protocol (h11) keeps a connection that sends nothing, or half a request's
headers, forever (its keep-alive timer only runs between requests), and `limit_concurrency` answers
503 to requests but still holds every connection's socket: 600 silent clients were enough to make a
server with a low fd limit stop answering (`Too many open files`). `Connections` (a subclass of
uvicorn's H11Protocol) adds, from the Policy (engine.serve.guard):
- `max_connections`: a connection over it gets a 503 (OpenAI's error body, Retry-After) and is
  closed at once, before anything is read: its socket is freed, not parked;
- `read_timeout`: a connection must deliver a request's complete headers within that many seconds of
  its first byte (or of opening, for the first request), else it is closed. Between requests
  uvicorn's keep-alive timeout (`keep_alive`) applies. The body's own timeout (a gap of more than
  `read_timeout` between its parts: 408) is the RequestGuard's, where the body is read;
- a lingering close: a request refused before its body was read (413 over --max-body, 415, 408)
  is answered, then the connection is half-closed (FIN after the answer) and what the client still
  sends is read and thrown away (never buffered) until it closes, for LINGER_S at most, as nginx's
  `lingering_close` does. A plain close with unread bytes makes the kernel send a reset,
  which destroys the answer in the client's buffers: a client that writes its whole body before
  reading (httpx's async client) got a connection reset instead of the 413.
"""
from __future__ import annotations

import errno
import json
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.errors import InvalidArgumentError
from engine.serve.errors import APIError
from engine.serve.guard import Policy

RETRY_AFTER_S = 1
LINGER_S = 5.0   # the most seconds a refused request's remaining body is read and discarded


def over_connections(limit: int) -> bytes:
    """The raw 503 a connection over the limit gets before it is closed."""
    body = json.dumps(APIError(503, f"The server holds its limit of {limit} connections (--max-connections); "
                                    f"retry after {RETRY_AFTER_S} s.", "server_error",
                               code="too_many_connections").body()).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % (RETRY_AFTER_S, len(body))) + body


class _Transport:
    """The connection's transport as uvicorn sees it: close() asks the protocol, which lingers while
    the client is still sending a body (Connections._close)."""

    def __init__(self, transport, protocol: Connections):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol._close()

    def is_closing(self) -> bool:
        return self._protocol._lingered is not None or self._transport.is_closing()


class Connections(H11Protocol):
    """uvicorn's h11 protocol with a connection limit, a deadline on request headers and a lingering
    close."""

    policy: Policy = Policy()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self._linger_timer = self._lingered = None
        self._closing_now = False
        self._raw, self.transport = transport, _Transport(transport, self)
        limit = self.policy.max_connections
        if limit and len(self.connections) > limit:
            transport.write(over_connections(limit))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingered is not None:   # the rest of a refused body: thrown away
            self._lingered += len(data)
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()        # part of a request's headers: the deadline runs from its first byte
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._closing_now = True
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self._closing_now = True     # the server stops: no lingering
        if self._lingered is not None:
            self._raw.close()
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot parse (a malformed request line, headers past h11's limit, a bad
        Content-Length, no Host): uvicorn's 400 with OpenAI's error body instead of its plain text.
        A request whose body breaks after its answer began (a bad chunk) can get no 400: the
        connection just closes; the app's own answer, if still to come, goes nowhere."""
        cycle = getattr(self, "cycle", None)
        if cycle is not None:
            cycle.disconnected = True   # the request's app task sends nothing more on this connection
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):   # an answer already went out
            self.transport.close()
            return
        body = json.dumps(APIError(400, f"{msg.rstrip('.')}: not valid HTTP/1.1 (a malformed request line or "
                                        "header, overlong headers, or no Host header)",
                                   code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _close(self) -> None:
        """Closes the connection; while the client is still sending a request's body, lingers: the
        answer goes out with a FIN after it, and the rest of the body is read and discarded until the
        client closes (eof) or LINGER_S have passed."""
        raw = self._raw
        if self._lingered is not None:
            return
        if (self._closing_now or raw.is_closing() or self.conn.their_state is not h11.SEND_BODY
                or not raw.can_write_eof()):
            raw.close()
            return
        self._disarm()
        try:
            raw.write_eof()      # after what is buffered: the client sees the answer, then the end
        except OSError:          # the client reset the connection already (ENOTCONN): nothing to linger for,
            raw.close()          # and a close that never ran would hold its socket against --max-connections
            return
        self._lingered = 0
        raw.resume_reading()     # uvicorn may have paused reading while the body was unread
        self._linger_timer = self.loop.call_later(LINGER_S, raw.close)

    def _arm(self) -> None:
        if self._header_timer is None and self.policy.read_timeout:
            self._header_timer = self.loop.call_later(self.policy.read_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def check_listen(host: str, port: int) -> None:
    """Bind (and release) every address `host` names at `port`, as the server will, so that an address
    in use, one this machine does not have, or an unknown name is one line (InvalidArgumentError)
    before the model loads, not uvicorn's log and exit 3 after it."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,   # "": every address, as asyncio
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InvalidArgumentError(f"--host {host}: {e.strerror.lower()}; give an address of this machine "
                                   f"(127.0.0.1: this machine alone; 0.0.0.0: every address)") from None
    for family, kind, proto, _, address in dict.fromkeys(addresses):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as asyncio's create_server
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
                why = {errno.EADDRINUSE: "the address is in use: stop what holds it or give another --port",
                       errno.EADDRNOTAVAIL: "this machine has no such address: give one of its own to --host "
                                            "(127.0.0.1: this machine alone; 0.0.0.0: every address)",
                       errno.EACCES: "permission denied (ports below 1024 need privileges): give a --port above 1023"
                       }.get(e.errno, f"{e.strerror}")
                raise InvalidArgumentError(f"cannot listen on {where}: {why}") from None


def uvicorn_config(app, policy: Policy, **kw) -> uvicorn.Config:
    """uvicorn's Config for `app` under `policy`'s connection limits (kw: host, port, log_level, ...)."""
    protocol = type("Connections", (Connections,), {"policy": policy})
    kw.setdefault("timeout_graceful_shutdown", 1)   # after engine.serve.shutdown's drain: answers still going out
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=policy.keep_alive, **kw)


__all__ = ["Connections", "check_listen", "uvicorn_config", "over_connections", "LINGER_S"]
