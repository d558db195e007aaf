"""Helpers for the server tests (no tests here): a uvicorn server in a thread on 127.0.0.1, a free port."""
from __future__ import annotations

import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")

from engine.api import load                    # noqa: E402
from engine.serve import GracefulServer, PrefixCache, Server, create_app, uvicorn_config   # noqa: E402
from engine.serve.guard import Policy   # noqa: E402

NAME = "small"
BACKEND = "auto"   # the server default


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A random tiny model with a byte-level BPE and a ChatML template (tests/chat_fixtures.py)."""
    pytest.importorskip("tokenizers")
    from chat_fixtures import bpe_model_dir
    return bpe_model_dir(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def live(small_model_dir):
    """The default server on the small model, one per test module."""
    srv = LiveServer(make_server(small_model_dir))
    yield srv
    srv.stop()


class LiveServer:
    """`server` behind uvicorn in a daemon thread; `.url`, `.stop()`. Starts and stops within seconds."""

    def __init__(self, server: Server, policy=None, grace: float | None = None):
        """grace: serve through engine.serve.shutdown's GracefulServer (`.uv.begin()` starts its drain,
        as a first SIGTERM would), without its hard exit."""
        self.server = server
        policy = policy if policy is not None else Policy()
        self.app = create_app(server, policy)
        config = uvicorn_config(self.app, policy, host="127.0.0.1", port=0, log_level="warning")
        self.uv = (uvicorn.Server(config) if grace is None
                   else GracefulServer(config, server, grace=grace, hard_exit=False))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.uv.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def scheduler(self):
        return self.server.scheduler

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once no sequence holds a state (bounded wait)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.scheduler.active == 0 and self.scheduler.states == 0 and not self.scheduler.pending:
                return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(20)


def make_server(model_dir, cache: bool = False, **limits) -> Server:
    llm = load(str(model_dir), backend=BACKEND)
    return Server(llm, NAME, cache=PrefixCache(max_entries=64 if cache else 0), **limits)


def client(live: LiveServer):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
