"""Graceful shutdown (engine.serve.shutdown): on SIGTERM/SIGINT nothing more is admitted (503), running
streams finish within --shutdown-grace, the rest end with an error event and [DONE] (streams) or a 503
(non-streaming); the process is gone within grace + 2 s, and at once on a second signal. In-process
(the drain, started as the signal would) and as a `gen serve` subprocess on 127.0.0.1 (real signals)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
from test_serve_batching import SlowSteps                      # noqa: E402
from test_serve_support import NAME, LiveServer, make_server    # noqa: E402
from engine.serve import print_cache_stats                      # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LONG = {"prompt": "the cat", "max_tokens": 10 ** 6, "attention": "linear", "ignore_eos": True}


def sse_lines(r) -> list[str]:
    return [line for line in r.iter_lines() if line]


def test_running_streams_finish_within_the_grace_and_new_requests_get_503(small_model_dir):
    """The drain (what the first signal starts): a queued request and a new one get 503
    shutting_down, /health 503; the running stream ends as usual (its tokens, finish_reason, [DONE],
    no error); then the server exits, long before the grace is over."""
    srv = LiveServer(make_server(small_model_dir, max_batch=1), grace=30.0)
    inner = srv.scheduler.stepper
    srv.scheduler.stepper = SlowSteps(inner)   # 40 tokens: ~0.4 s
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 40, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=30) as h, h.stream("POST", srv.url + "/v1/completions", json=body) as r, \
                ThreadPoolExecutor(1) as pool:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            queued = pool.submit(httpx.post, srv.url + "/v1/completions", timeout=30,
                                 json={"model": NAME, "prompt": "x", "max_tokens": 2})
            deadline = time.monotonic() + 10
            while not srv.scheduler.pending and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            srv.uv.begin()
            assert queued.result().status_code == 503 and queued.result().json()["error"]["code"] == "shutting_down"
            new = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=10)
            assert new.status_code == 503 and new.headers["retry-after"] == "1"
            assert new.json()["error"]["code"] == "shutting_down"
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest), rest[-3:]
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        srv.thread.join(10)
        print("exited after", time.monotonic() - t0)
        assert not srv.thread.is_alive()   # gone once the stream ended, not at the end of the grace
        assert time.monotonic() - t0 < 10
    finally:
        srv.scheduler.stepper = inner
        srv.stop()


# ---------------------------------------------------------------------- gen serve, real signals
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`gen serve --model DIR` in a subprocess on 127.0.0.1 (started within 60 s, killed at the end)."""

    def __init__(self, model_dir, *args: str):
        self.port, self.model = free_port(), str(model_dir)
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", self.model,
                                      "--port", str(self.port), "--max-tokens-cap", "0", *args],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("gen serve did not start:\n" + "".join(self.log))
            time.sleep(0.1)

    def body(self, **kw) -> dict:
        return dict(LONG, model=self.model, **kw)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def open_stream(served: Served):
    """A long stream, its first token read: (client, context manager, line iterator)."""
    h = httpx.Client(timeout=30)
    cm = h.stream("POST", served.url + "/v1/completions", json=served.body(stream=True))
    lines = cm.__enter__().iter_lines()
    assert next(lines).startswith("data: {")
    return h, cm, lines


def test_sigterm_ends_what_outlives_the_grace_with_an_error_event_and_done_then_exits(small_model_dir):
    grace = 1.0
    served = Served(small_model_dir, "--shutdown-grace", str(grace))
    try:
        h, cm, lines = open_stream(served)
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, served.url + "/v1/completions", json=served.body(), timeout=30)
            deadline = time.monotonic() + 10
            while httpx.get(served.url + "/stats").json()["active"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            t0 = time.monotonic()
            served.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
            answer = whole.result()
        cm.__exit__(None, None, None)
        h.close()
        served.proc.wait(grace + 5)
        took = time.monotonic() - t0
        print("exit status", served.proc.returncode, "after", took, "s;", "".join(served.log)[-600:])
        assert rest[-1] == "data: [DONE]", rest[-3:]
        assert json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
        assert took < grace + 2
        assert served.proc.returncode == -signal.SIGTERM   # uvicorn raises the signal again once done
        assert "prefix cache:" in "".join(served.log)      # the exit summary, printed before that
    finally:
        served.kill()


def test_a_second_signal_exits_at_once(small_model_dir):
    served = Served(small_model_dir, "--shutdown-grace", "60")
    try:
        h, cm, lines = open_stream(served)
        served.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert served.proc.poll() is None   # draining: the stream may run for 60 s
        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGINT)
        served.proc.wait(5)
        print("exit status", served.proc.returncode, "after", time.monotonic() - t0)
        assert served.proc.returncode == 128 + signal.SIGINT
        h.close()
    finally:
        served.kill()


def test_the_exit_summary_of_an_empty_prefix_cache_says_nothing_is_held(capsys):
    """A server that cached no prompt ended its summary with a dangling 'held: '."""
    stats = {"hits": 0, "misses": 0, "tokens_saved": 0, "time_saved_s": 0.0, "by_path": {}}
    server = SimpleNamespace(scheduler=SimpleNamespace(cache=SimpleNamespace(stats=lambda: stats)))
    print_cache_stats(server)
    assert capsys.readouterr().out.rstrip().endswith("; held: nothing")
    stats["by_path"] = {"softmax": {"entries": 2, "bytes": 2**20}}
    print_cache_stats(server)
    assert capsys.readouterr().out.rstrip().endswith("; held: softmax: 2 prompts, 1.00 MiB")
