"""What the benchmark scripts share: string options with defaults, the load average, JSON written whole,
and the serving benchmarks' pieces (serve_bench.py, serve_soak.py): `gen serve` in a subprocess with its
RSS, and a streaming client that times each SSE event.

The scripts run as `python benchmarks/NAME.py`, so this module is imported as `common`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def options(doc: str, **defaults: str) -> argparse.ArgumentParser:
    """A parser described by the first line of `doc`, with `--name` (underscores as dashes) for each
    default; callers add their other options to it."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), default=default, help=f"default: {default}")
    return ap


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_json(path: str, obj) -> None:
    """Write `obj` to `path` whole or not at all (a .tmp file, then renamed)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, cmd: list[str]):
        """The server `cmd` on a free port (written where cmd says {port}), once its /health answers."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.cmd = cmd
        # the server's log goes to a file: an unread pipe fills up and blocks the server's event loop
        self.log = tempfile.NamedTemporaryFile("w+", prefix="gen-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{cmd[0]} did not start within 300 s")

    def cpu_s(self) -> float:
        """The server process's CPU seconds so far (user + system)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def thread_cpu_s(self) -> dict[int, float]:
        """CPU seconds so far of each of the server's threads, by OS thread id."""
        out = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:   # the thread ended
                continue
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    def rss(self, field: str = "VmRSS") -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> str:
        """Stop the server (Ctrl-C's signal); returns the tail of its log (the prefix cache's summary)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        lines = Path(self.log.name).read_text().splitlines()
        return "\n".join(lines[-3:])


class RssSampler:
    """The server's peak VmRSS while a block runs (sampled every 50 ms)."""

    def __init__(self, server: ServerProcess):
        self.server, self.peak, self._stop = server, 0, threading.Event()

    def __enter__(self):
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.server.rss())
            time.sleep(0.05)

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


async def stream_one(client, url: str, body: dict, disconnect_after: int | None = None,
                     read_delay: float = 0.0) -> dict:
    """One streaming completion; times per token chunk. disconnect_after: leave after that many chunks;
    read_delay: sleep that many seconds after each read (a slow reader; httpx clients only).
    A stream silent for the client's read timeout is reported as lost (status 0), with what it got.
    client: an httpx.AsyncClient, or a RawClient (the load runs' leaner reader).

    The load generator shares the server's cores, so it does the least it can while the stream runs:
    it keeps each SSE event's bytes with the time its read returned and parses the JSON afterwards
    (events that arrive in one read share its time: they did arrive together)."""
    t0 = time.perf_counter()
    events: list[tuple[float, bytes]] = []
    read = client.read_events if isinstance(client, RawClient) else partial(_read_events, client, delay=read_delay)
    try:
        status, error, left = await read(url, body, disconnect_after, events)
    except (httpx.TimeoutException, TimeoutError) as e:
        return {"status": 0, "error": f"{type(e).__name__} after {len(events)} chunks", "chunks": len(events)}
    if status != 200:
        return {"status": status, "error": error}
    if left:
        return {"status": 200, "disconnected": True}
    times, tokens, text, reason = [], [], "", None
    for t, data in events:
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            return {"status": 500, "error": obj["error"]["message"]}
        if not obj["choices"]:
            continue
        ch = obj["choices"][0]
        got = (ch.get("logprobs") or {}).get("tokens", [])
        if got or ch["text"]:   # a token (llama-server ends with an empty chunk that only says why)
            times.append(t)
        tokens += got
        text += ch["text"]
        reason = ch["finish_reason"] or reason
    return {"status": 200, "t0": t0, "times": times, "tokens": tokens, "text": text, "finish_reason": reason}


async def _read_events(client, url, body, disconnect_after, events, delay: float = 0.0) -> tuple[int, str | None, bool]:
    """Append (arrival time, data bytes) per SSE event until [DONE]; returns (status, error, left):
    left when the client went away after `disconnect_after` events; `delay`: seconds slept after each read."""
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()[:200], False
        events_in = SSEBuffer(events)
        async for chunk in r.aiter_raw():
            if events_in.add(chunk, time.perf_counter()):
                return 200, None, False
            if disconnect_after is not None and len(events) >= disconnect_after:
                return 200, None, True
            if delay:
                await asyncio.sleep(delay)
    return 200, None, False


class SSEBuffer:
    """SSE events out of bytes that arrive in arbitrary pieces: (arrival time, data bytes) per event."""

    def __init__(self, events: list):
        self.events, self.buf = events, b""

    def add(self, chunk: bytes, t: float) -> bool:
        """Take one read's bytes; True once `data: [DONE]` has arrived."""
        self.buf += chunk
        *done, self.buf = self.buf.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in done:
            data = b"".join(line[6:] for line in event.split(b"\n") if line.startswith(b"data: "))
            if data:
                self.events.append((t, data))
                if data == b"[DONE]":
                    return True
        return False


class RawClient:
    """One keep-alive HTTP/1.1 connection on plain asyncio streams, for the load runs: httpx spends
    ~0.1 ms of CPU per streamed token on the cores the server is measured on; this reads the
    chunked SSE body with a readline and a readexactly per chunk. The soak keeps httpx."""

    def __init__(self, timeout: float = 600):
        self.timeout, self.conn = timeout, None

    async def read_events(self, url, body, disconnect_after, events) -> tuple[int, str | None, bool]:
        async with asyncio.timeout(self.timeout):
            return await self._read(httpx.URL(url), body, disconnect_after, events)

    async def _read(self, url, body, disconnect_after, events):
        payload = json.dumps(body).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (url.host.encode(), len(payload), payload))
        for attempt in (0, 1):
            fresh = self.conn is None
            if fresh:
                self.conn = await asyncio.open_connection(url.host, url.port)
            reader, writer = self.conn
            writer.write(request)
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                break
            except (asyncio.IncompleteReadError, ConnectionError):
                # a kept connection the server had closed (llama-server closes after each stream): once more
                self.close()
                if fresh or attempt:
                    raise
        status = int(head[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:] if ":" in line)}
        if "content-length" in headers:   # an error answer (400, 429, ...)
            text = (await reader.readexactly(int(headers["content-length"]))).decode()[:200]
            if headers.get("connection", "").lower() == "close":
                self.close()
            return status, text, False
        events_in, finished = SSEBuffer(events), False
        while True:   # chunked transfer coding: size line, data, CRLF; a zero size ends the body
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return 200, None, False
            chunk = (await reader.readexactly(size + 2))[:-2]
            if not finished:
                finished = events_in.add(chunk, time.perf_counter())
            if not finished and disconnect_after is not None and len(events) >= disconnect_after:
                self.close()
                return 200, None, True

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]
