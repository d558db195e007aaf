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
  `read_timeout` between its parts: 408) is the RequestGuard's, where the body is read.
"""
from __future__ import annotations

import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serve.errors import APIError
from engine.serve.guard import Policy

RETRY_AFTER_S = 1


def over_connections(limit: int) -> bytes:
    """The raw 503 a connection over the limit gets before it is closed."""
    body = json.dumps(APIError(503, f"The server holds its limit of {limit} connections (--max-connections); "
                                    f"retry after {RETRY_AFTER_S} s.", "server_error",
                               code="too_many_connections").body()).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % (RETRY_AFTER_S, len(body))) + body


class Connections(H11Protocol):
    """uvicorn's h11 protocol with a connection limit and a deadline on request headers."""

    policy: Policy = Policy()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        limit = self.policy.max_connections
        if limit and len(self.connections) > limit:
            transport.write(over_connections(limit))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()        # part of a request's headers: the deadline runs from its first byte
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

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


def uvicorn_config(app, policy: Policy, **kw) -> uvicorn.Config:
    """uvicorn's Config for `app` under `policy`'s connection limits (kw: host, port, log_level, ...)."""
    protocol = type("Connections", (Connections,), {"policy": policy})
    kw.setdefault("timeout_graceful_shutdown", 1)   # after engine.serve.shutdown's drain: answers still going out
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=policy.keep_alive, **kw)


__all__ = ["Connections", "uvicorn_config", "over_connections"]
