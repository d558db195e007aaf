"""benchmarks/serve_bench.py's stream reader (SSE events split anywhere across reads, parsed after the
stream; a client leaving early) and serve_table.py's 16-vs-1 ratio over interleaved repeats. No timing."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import serve_bench  # noqa: E402
import serve_table  # noqa: E402


def sse_bytes(texts, reason="length") -> bytes:
    out = b""
    for i, t in enumerate(texts):
        obj = {"choices": [{"text": t, "logprobs": {"tokens": [f"<{t}>"]},
                            "finish_reason": reason if i == len(texts) - 1 else None}]}
        out += b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"
    return out + b"data: [DONE]\r\n\r\n"


def read(body: bytes, cut: int, disconnect_after=None) -> dict:
    """Stream `body` in pieces of `cut` bytes (splitting events and even \\r\\n pairs) through stream_one."""
    async def pieces():
        for i in range(0, len(body), cut):
            yield body[i:i + cut]

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=pieces()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve_bench.stream_one(client, "http://test", {}, disconnect_after)
    return asyncio.run(go())


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_stream_reader_parses_events_split_anywhere(cut):
    got = read(sse_bytes(["Once", " upon", " a\ntime"]), cut)
    assert got["status"] == 200 and got["finish_reason"] == "length"
    assert got["text"] == "Once upon a\ntime" and got["tokens"] == ["<Once>", "< upon>", "< a\ntime>"]
    assert len(got["times"]) == 3


def test_stream_reader_counts_tokens_not_the_closing_chunk():
    """llama-server (the peer --llama-server measures) sends no logprobs and ends with an empty chunk
    that only carries finish_reason: 3 tokens, not 4."""
    chunks = [{"text": t, "logprobs": None, "finish_reason": None} for t in ["Once", " upon", " a"]]
    chunks.append({"text": "", "logprobs": None, "finish_reason": "length"})
    body = b"".join(b"data: " + json.dumps({"choices": [c]}).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    got = read(body, 11)
    assert got["text"] == "Once upon a" and got["finish_reason"] == "length" and len(got["times"]) == 3


def test_stream_reader_reports_a_client_that_left_and_an_error_event():
    assert read(sse_bytes(["a", "b", "c", "d"]), 5, disconnect_after=2) == {"status": 200, "disconnected": True}
    err = b'data: {"choices": [{"text": "a", "finish_reason": null}]}\r\n\r\ndata: {"error": {"message": "boom"}}\r\n\r\n'
    assert read(err, 4) == {"status": 500, "error": "boom"}


def run(path, clients, rep, tps, steps_s=0.1):
    return {"path": path, "clients": clients, "repeat": rep, "tokens_per_s": tps, "tokens": 100, "server_cpu_s": 0.1,
            "steps_wall_s": steps_s, "loop_tokens": 100,
            "ttft_p50_ms": 1, "ttft_p99_ms": 1, "itl_p50_ms": 1, "itl_p99_ms": 1, "server_peak_rss_mib": 1,
            "load_average": 1.0}


def test_table_gives_the_median_ratio_of_interleaved_pairs():
    runs = [run("linear", 1, 0, 200, 0.2), run("linear", 16, 0, 500), run("linear", 1, 1, 100, 0.4),
            run("linear", 16, 1, 300), run("linear", 1, 2, 100, 0.3), run("linear", 16, 2, 400)]
    results = {"command": "x", "machine": {"load_average_at_start": [1, 1, 1]},
               "settings": {"paths": "linear", "budget_gib": 1}, "runs": runs}
    text = serve_table.table(results)
    assert "16 clients / 1 client = 3.00x tokens/s, median of 3 interleaved pairs (2.50, 3.00, 4.00)" in text
    assert "the decode steps alone (wall ms in steps per token, 1 client over 16): 3.00x (2.00, 4.00, 3.00)" in text


def raw_exchange(responses: list[bytes], requests: int, disconnect_after=None) -> list[dict]:
    """RawClient against a bare asyncio server answering each request on one connection with the next of
    `responses` (raw HTTP bytes, written in 5-byte pieces)."""
    async def go():
        connections = []

        async def handle(reader, writer):
            connections.append(1)
            for answer in responses:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
                await reader.readexactly(length)
                for i in range(0, len(answer), 5):
                    writer.write(answer[i:i + 5])
                    await writer.drain()
            writer.close()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = serve_bench.RawClient(timeout=10)
        try:
            got = [await serve_bench.stream_one(client, url, {"n": i}, disconnect_after) for i in range(requests)]
        finally:
            client.close()
            server.close()
        return got, len(connections)
    return asyncio.run(go())


def chunked(body: bytes, pieces: int = 3) -> bytes:
    step = max(1, len(body) // pieces)
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n")


def test_raw_client_reads_chunked_streams_and_errors_on_one_connection():
    busy = b'{"error": {"message": "busy"}}'
    responses = [chunked(sse_bytes(["a", "b"])), b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(busy), busy), chunked(sse_bytes(["x", "y", "z"], reason="stop"), pieces=7)]
    (first, second, third), connections = raw_exchange(responses, 3)
    assert connections == 1                                     # keep-alive: one connection for all three
    assert (first["text"], first["tokens"], first["finish_reason"]) == ("ab", ["<a>", "<b>"], "length")
    assert second == {"status": 429, "error": busy.decode()}
    assert (third["text"], third["finish_reason"], len(third["times"])) == ("xyz", "stop", 3)
