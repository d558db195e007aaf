"""`gen serve --open`: the page's address, and the browser opened once the server answers."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from cli.open_page import open_when_ready, page_url


@pytest.mark.parametrize("host, url", [("127.0.0.1", "http://127.0.0.1:8000/"), ("0.0.0.0", "http://127.0.0.1:8000/"),
                                       ("::", "http://[::1]:8000/"), ("localhost", "http://localhost:8000/")])
def test_page_url(host, url):
    assert page_url(host, 8000) == url


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_browser_opens_once_the_server_answers():
    opened = []
    with ThreadingHTTPServer(("127.0.0.1", 0), Health) as httpd:
        url = page_url("127.0.0.1", httpd.server_address[1])
        waiter = open_when_ready(url, timeout=10, opener=lambda u: opened.append(u) or True, poll=0.05)
        waiter.join(0.5)
        assert opened == [] and waiter.is_alive()          # nothing answers yet: it waits
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        waiter.join(10)
        httpd.shutdown()
    assert opened == [url]


def test_gen_serve_open_wires_it(monkeypatch):
    import cli.serve as serve
    calls = []
    monkeypatch.setattr(serve, "check_listen", lambda host, port: None)   # port 8000 may be taken here
    monkeypatch.setattr(serve, "open_server", lambda *a, **k: "server")
    monkeypatch.setattr(serve, "run", lambda server, host, port, **policy: calls.append(("run", host, port)))
    monkeypatch.setattr(serve, "open_when_ready", lambda url: calls.append(("open", url)))
    r = CliRunner().invoke(serve.serve_cmd, ["--port", "8123", "--open"])
    assert r.exit_code == 0, r.output
    assert calls == [("open", "http://127.0.0.1:8123/"), ("run", "127.0.0.1", 8123)]
    calls.clear()
    assert CliRunner().invoke(serve.serve_cmd, ["--port", "8123"]).exit_code == 0
    assert calls == [("run", "127.0.0.1", 8123)]
