"""One sampler and one sequence loop for every caller: the same seeded request gives the same tokens,
text and finish reason from `llm.generate`, from `gen --json` and from `gen serve`, on both paths
(engine.sampling: one seeded uniform a row; engine.sequence: one set of finish rules)."""
from __future__ import annotations

import json
import queue

import pytest
from click.testing import CliRunner

from cli.main import main
from engine import load
from engine.serve import Server
from engine.serve.scheduler import Failure
from engine.serve.schemas import CompletionRequest
from test_serve_support import LiveServer

httpx = pytest.importorskip("httpx")

PROMPT, SEED, N = "Once upon a time", 7, 24
SETTINGS = dict(temperature=0.9, top_k=20, seed=SEED, max_new_tokens=N)


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(Server(load("tiny"), "tiny"))
    yield srv
    srv.stop()


def scheduled_ids(live, body: dict) -> tuple[list[int], str | None]:
    """The ids and finish reason the server's scheduler delivers for `body` (its Tokens, which the
    HTTP answer only shows as text)."""
    server, got = live.server, queue.Queue()
    req = CompletionRequest(**body)
    server.submit(server.make_job(req, server.completion_ids(req), got.put, None))
    ids = []
    while True:
        token = got.get(timeout=60)
        assert not isinstance(token, Failure), token
        ids.append(token.id)
        if token.finish_reason is not None:
            return ids, token.finish_reason


def stop_inside(text: str) -> str:
    """A stop string taken from the middle of `text` (so a run with it is cut there)."""
    middle = text[len(text) // 2:]
    word = middle.split()[0] if middle.split() else ""
    assert word, text
    return word


@pytest.mark.parametrize("path", ["softmax", "linear"])
@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop-string"])
def test_a_seeded_request_is_the_same_everywhere(live, path, stop):
    settings, flags, extra = dict(SETTINGS), [], {}
    if stop:   # a stop string met halfway: the three cut at the same place, finish_reason "stop"
        word = stop_inside(load("tiny", attention=path).generate(PROMPT, **SETTINGS).text)
        settings["stop"], flags, extra = [word], ["--stop", word], {"stop": [word]}
    api = load("tiny", attention=path).generate(PROMPT, **settings)
    assert api.finish_reason == ("stop" if stop else "length")
    r = CliRunner().invoke(main, ["--model", "tiny", "--attention", path, "--json", "--temperature", "0.9",
                                  "--top-k", "20", "--seed", str(SEED), "-n", str(N), *flags, PROMPT])
    assert r.exit_code == 0, r.output
    cli = json.loads(r.stdout)
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0.9, "top_k": 20, "seed": SEED, "max_tokens": N,
            "attention": path, **extra}
    served = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    choice = served["choices"][0]
    print(api.text, "|", choice["text"])
    assert (cli["ids"], cli["text"], cli["finish_reason"]) == (api.ids, api.text, api.finish_reason)
    assert (choice["text"], choice["finish_reason"]) == (api.text, api.finish_reason)
    assert served["usage"]["completion_tokens"] == len(api.ids)
    assert scheduled_ids(live, body) == (api.ids, api.finish_reason)
    other = load("tiny", attention=path).generate(PROMPT, **{**settings, "seed": SEED + 1})
    assert other.ids != api.ids          # the seed decides: the equalities above are not vacuous
