"""The `gen` field of stream chunks (stream_options.include_stats) and the page's routes, over HTTP
(httpx). The page itself in a browser: test_web_page.py."""
from __future__ import annotations

import json
from importlib import resources

import pytest

from test_serve_support import NAME, LiveServer, chat_model_dir, make_server, live  # noqa: F401 (fixtures)

httpx = pytest.importorskip("httpx")


def stream(live, body: dict) -> list[dict]:
    body = {"model": NAME, "stream": True, "temperature": 0, **body}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def kv_row_bytes(live, tokens: int) -> int:
    return live.server.llm.model.init_state(batch=1, max_len=tokens, attention="softmax").nbytes


def linear_row_bytes(live) -> int:
    return live.server.llm.model.init_state(batch=1, attention="linear").nbytes


@pytest.mark.parametrize("path", ["softmax", "linear"])
def test_every_chunk_carries_the_rows_own_numbers(live, path):
    chunks = stream(live, {"prompt": "the cat sat on", "max_tokens": 12, "ignore_eos": True, "attention": path,
                           "stream_options": {"include_stats": True, "include_usage": True}})
    usage = chunks[-1]["usage"]
    # a token whose text is held back sends no chunk; the last token's finish_reason comes in a chunk of its own
    tokens = [c for c in chunks if c["choices"] and not c["choices"][0]["finish_reason"]]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["gen"] == tokens[-1]["gen"]
    assert all("gen" in c for c in tokens) and tokens[-1]["gen"]["completion_tokens"] == 12
    counted = [c["gen"]["completion_tokens"] for c in tokens]
    assert counted == sorted(set(counted))
    for c in tokens:
        g, n = c["gen"], c["gen"]["completion_tokens"]
        assert g["attention"] == path and g["prompt_tokens"] == usage["prompt_tokens"]
        assert g["context"] == g["prompt_tokens"] + n
        assert g["state_tokens"] == g["context"] - 1        # the last sampled token is fed at the next step
        want = kv_row_bytes(live, g["state_tokens"]) if path == "softmax" else linear_row_bytes(live)
        assert g["state_bytes"] == want
        assert g["ttft_ms"] > 0
        if n == 1:
            assert g["token_ms"] is None and g["ms_per_token"] is None and g["tokens_per_s"] is None
        else:
            assert g["token_ms"] >= 0 and g["ms_per_token"] > 0
            assert g["tokens_per_s"] == pytest.approx(1000 / g["ms_per_token"])
    bytes_seen = [c["gen"]["state_bytes"] for c in tokens]
    if path == "softmax":
        assert bytes_seen == sorted(set(bytes_seen))            # grows with every token
    else:
        assert len(set(bytes_seen)) == 1                        # constant


@pytest.mark.filterwarnings("ignore:these weights were trained")   # hybrid on weights not trained for it
def test_hybrid_and_window_rows(small_model_dir):
    """A hybrid row grows by its KV layers' bytes per token only; a windowed linear row holds its
    W-key buffer whole from the start: both as a batch-1 state of that many tokens holds."""
    from engine.api import load
    from engine.serve import Server
    srv = LiveServer(Server(load(str(small_model_dir), softmax_layers=[0], window=4), NAME))
    try:
        model = srv.server.llm.model
        for path in ("hybrid", "linear"):
            run = {"attention": path, "window": 4, **({"softmax_layers": [0]} if path == "hybrid" else {})}
            chunks = stream(srv, {"prompt": "the cat sat on", "max_tokens": 8, "ignore_eos": True, **run,
                                  "stream_options": {"include_stats": True}})   # a request names its whole run
            seen = [c["gen"]["state_bytes"] for c in chunks if not c["choices"][0]["finish_reason"]]
            for c in chunks:
                held = c["gen"]["state_tokens"]
                spec = srv.server.llm.spec.for_request(model.config, **run)
                assert c["gen"]["state_bytes"] == model.init_state(batch=1, max_len=held, spec=spec).nbytes
            if path == "hybrid":
                assert seen == sorted(set(seen))
            else:
                assert len(set(seen)) == 1
    finally:
        srv.stop()


def test_the_rows_bytes_are_its_own_while_batched(live):
    """Two softmax requests of different lengths at once: each chunk's state_bytes is its own row's."""
    import concurrent.futures as cf
    bodies = [{"prompt": p, "max_tokens": 24, "ignore_eos": True, "attention": "softmax",
               "stream_options": {"include_stats": True}} for p in ("a", "the cat sat on the mat and then")]
    with cf.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda b: stream(live, b), bodies))
    for chunks in results:
        for c in chunks:
            assert c["gen"]["state_bytes"] == kv_row_bytes(live, c["gen"]["state_tokens"])
    assert results[0][-1]["gen"]["state_bytes"] < results[1][-1]["gen"]["state_bytes"]


def test_chat_chunks_carry_them_too(chat_model_dir):
    srv = LiveServer(make_server(chat_model_dir))
    try:
        body = {"model": NAME, "stream": True, "temperature": 0, "max_tokens": 5, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_stats": True}}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        counted = [c["gen"]["completion_tokens"] for c in chunks if "gen" in c]
        assert counted and counted[-1] == 5
    finally:
        srv.stop()


def test_without_asking_the_chunks_are_openais(live):
    chunks = stream(live, {"prompt": "the cat", "max_tokens": 4, "stream_options": {"include_usage": True}})
    assert chunks and not any("gen" in c for c in chunks)
    chunks = stream(live, {"prompt": "the cat", "max_tokens": 4})
    assert not any("gen" in c for c in chunks)


def test_stats_need_a_stream(live):
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2,
                                                       "stream_options": {"include_stats": True}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- the page's routes
def test_the_page_and_its_files(live):
    from engine.serve.page import ASSETS, PUBLIC_PATHS
    r = httpx.get(live.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    for path in PUBLIC_PATHS - {"/"}:
        got = httpx.get(live.url + path)
        assert got.status_code == 200 and got.content == resources.files("engine.serve").joinpath(
            "web", path.rsplit("/", 1)[1]).read_bytes()
        assert f'"{path}"' in r.text               # index.html loads every file it is served with
    assert set(ASSETS) == {p.name for p in resources.files("engine.serve").joinpath("web").iterdir()}
    missing = httpx.get(live.url + "/web/nothing.js")
    assert missing.status_code == 404 and "error" in missing.json()


def test_the_package_ships_the_page():
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path
    from fnmatch import fnmatch
    from engine.serve.page import ASSETS
    cfg = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["engine.serve"]
    assert all(any(fnmatch(f"web/{name}", g) for g in globs) for name in ASSETS)


@pytest.mark.filterwarnings("ignore:these weights were trained")   # hybrid on weights not trained for it
def test_config_offers_what_the_server_runs(live, small_model_dir):
    cfg = httpx.get(live.url + "/web/config").json()
    assert cfg["model"] == NAME and cfg["chat"] is False
    assert [c["id"] for c in cfg["configurations"]] == ["default", "softmax", "linear"]
    assert cfg["configurations"][0]["attention"] is None
    from engine.api import load
    from engine.serve import Server
    from engine.serve.page import page_config
    hybrid = page_config(Server(load(str(small_model_dir), softmax_layers=[0], window=4), NAME))
    offered = {c["id"]: c for c in hybrid["configurations"]}
    assert offered["hybrid"]["attention"] == "hybrid" and "softmax layers 0" in offered["hybrid"]["label"]
    assert "window 4" in offered["linear"]["label"] and hybrid["window"] == 4


def test_chat_models_are_chatted_with(chat_model_dir):
    from engine.api import load
    from engine.serve import Server
    from engine.serve.page import page_config
    assert page_config(Server(load(str(chat_model_dir)), NAME))["chat"] is True


def test_bench_files_are_listed_and_served_read_only(live, tmp_path):
    from engine.serve.page import bench_files
    report = {"settings": {"model": "m", "machine": {"cpu": "c"}},
              "results": [{"context": 8, "decode_ms_per_token": 1.0, "state_bytes": 10, "attention": "linear"}]}
    (tmp_path / "a_bench.json").write_text(json.dumps(report))
    (tmp_path / "other.json").write_text(json.dumps({"settings": {}, "runs": []}))
    (tmp_path / "broken.json").write_text("{")
    assert list(bench_files(tmp_path)) == ["a_bench.json"]
    listed = httpx.get(live.url + "/web/bench").json()["files"]
    names = [f["name"] for f in listed]
    assert names == list(bench_files())      # the checkout's docs/ (none when installed)
    if names:
        got = httpx.get(live.url + "/web/bench/" + names[0]).json()
        assert "results" in got and "settings" in got
    for bad in ("serve_bench_tiny.json", "nothing.json"):      # a JSON file that is no bench report; none
        r = httpx.get(live.url + "/web/bench/" + bad)
        assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(live.url + "/web/bench/..%2Fpyproject.toml")
    assert r.status_code == 404 and "build-system" not in r.text
