"""A body over --max-body gets the 413 in OpenAI's error shape through every kind of client, also one
that writes its whole body before it reads the answer (httpx's async client): the server answers,
then reads and discards the rest of the body before it closes (engine.serve.connections' lingering
close), instead of a close that resets the connection and destroys the answer. Issue 29."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
from test_serve_support import NAME, LiveServer, make_server

from engine.serve.guard import Policy

LIMIT = 1000
BODY = json.dumps({"model": NAME, "prompt": "word " * (2 << 20), "max_tokens": 2}).encode()   # 10 MiB
JSON = {"content-type": "application/json"}
URL = "/v1/completions"


@pytest.fixture(scope="module")
def live(small_model_dir):
    srv = LiveServer(make_server(small_model_dir), Policy(max_body=LIMIT))
    yield srv
    srv.stop()


def pieces(data: bytes, size: int = 1 << 16):
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def apieces(data: bytes):
    for p in pieces(data):
        yield p


def async_httpx(live, chunked: bool):
    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            return await c.post(live.url + URL, content=apieces(BODY) if chunked else BODY, headers=JSON)
    r = asyncio.run(go())
    return r.status_code, r.content


def sync_httpx(live, chunked: bool):
    r = httpx.post(live.url + URL, content=pieces(BODY) if chunked else BODY, headers=JSON, timeout=30)
    return r.status_code, r.content


def openai_client(live, chunked: bool):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=NAME, prompt=json.loads(BODY)["prompt"], max_tokens=2)
    return e.value.status_code, e.value.response.content


def raw_socket(live, chunked: bool):
    """Writes the whole request (Content-Length, or chunked with no length) before reading a byte."""
    if chunked:
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces(BODY)) + b"0\r\n\r\n"
        length = b"Transfer-Encoding: chunked"
    else:
        body, length = BODY, b"Content-Length: %d" % len(BODY)
    head = b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (URL.encode(), length)
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as s:
        s.sendall(head + body)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    return int(status.split()[1]), rest.partition(b"\r\n\r\n")[2]


CASES = {   # the openai client always sends a Content-Length
    "async httpx": (async_httpx, False), "async httpx chunked": (async_httpx, True),
    "sync httpx": (sync_httpx, False), "sync httpx chunked": (sync_httpx, True),
    "openai": (openai_client, False),
    "raw socket": (raw_socket, False), "raw socket chunked": (raw_socket, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_oversized_body_gets_the_413_through_every_client(live, case):
    client, chunked = CASES[case]
    status, body = client(live, chunked)
    assert status == 413, (status, body[:200])
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and f"{LIMIT} bytes" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert httpx.post(live.url + URL, json={"model": NAME, "prompt": "the cat", "max_tokens": 2},
                      timeout=30).status_code == 200   # and the server goes on answering


def test_a_refused_client_that_goes_on_holding_the_connection_is_closed_after_the_linger(live, monkeypatch):
    """The discarding read is bounded in time: a client that announced 100 MB, sent 10 bytes, read
    the 413 and then neither sends nor closes is closed by the server after LINGER_S."""
    from engine.serve import connections
    monkeypatch.setattr(connections, "LINGER_S", 0.3)
    head = (f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 << 20}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        s.sendall(head + b'{"model": ')
        answer = b""
        while chunk := s.recv(1 << 16):    # the answer, then the server's FIN
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413"), answer
        held = live.uv.server_state.connections
        deadline = time.monotonic() + 10
        while held and time.monotonic() < deadline:   # bounded wait for the server to let go
            time.sleep(0.05)
        assert not held, "the server still holds the refused connection"



def test_a_connection_reset_before_the_half_close_is_closed_not_held():
    """A client that reads the start of the 413 and closes with the answer's rest unread resets the
    connection; the server's half-close then fails (ENOTCONN). It must close the connection instead:
    uvicorn's later closes see it lingering and do nothing, so each one was held for good against
    --max-connections (a hostile client's 15 oversized uploads left a server with a limit of 10
    answering everything 503, each with a traceback in its log)."""
    import errno
    from types import SimpleNamespace

    import h11

    from engine.serve.connections import Connections

    class ResetTransport:
        closed = 0

        def is_closing(self):
            return self.closed > 0

        def can_write_eof(self):
            return True

        def write_eof(self):
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

        def resume_reading(self):
            raise AssertionError("nothing to read from a reset connection")

        def close(self):
            self.closed += 1

    conn = Connections.__new__(Connections)   # the state connection_made leaves, on a client still sending a body
    conn._raw, conn._lingered, conn._closing_now, conn._header_timer = ResetTransport(), None, False, None
    conn.conn = SimpleNamespace(their_state=h11.SEND_BODY)
    conn._close()
    assert conn._raw.closed == 1 and conn._lingered is None
