"""Run llama.cpp's own server tests (tools/server/tests in its source) against `gen serve`.

    python benchmarks/llama_server_tests.py /path/to/llama.cpp [--model smollm2] [--all] [-- pytest args]

Not part of this project's test suite, and no test of llama.cpp is copied here: the tests are run
from a llama.cpp checkout given on the command line (its tools/server/tests directory). A pytest
plugin patches the suite's `utils.ServerProcess` so that `server.start()` launches
`gen serve --model MODEL` (a local model in place of the suite's --hf-repo downloads) with its
flags mapped to gen serve's:

    n_slots -> --max-batch          n_ctx -> --max-context n_ctx / n_slots (llama-server splits it)
    n_predict -> --max-tokens-cap   api_key -> --api-key
    model_alias -> --served-model-name (first), plus the model names the suite's OpenAI-SDK tests
                   send (gpt-3.5-turbo-instruct, gpt-3.5-turbo, davinci-002) as further names
    cors_origins "localhost" -> --cors-origin for http://localhost, http://127.0.0.1, http://[::1]

and llama-server's unversioned OpenAI routes (/chat/completions, /models) to /v1/... for requests the
suite makes itself (an OpenAI client with a base_url without /v1 is not rerouted). Downloads are off
(`ServerPreset.load_all` does nothing; `wget` is a stub), the server gets a free port.

By default the subset the project's issue 29 names is run: the OpenAI-SDK, streaming, logprobs and
invalid-request tests of unit/test_chat_completion.py, the OpenAI-SDK tests of
unit/test_completion.py, the API-key and CORS tests of unit/test_security.py (--all: every test of
those files). Expected failures that are llama.cpp's own, not OpenAI's: the content regexes (they
match the stories260K model's text), `system_fingerprint` starting with "b" (llama.cpp's build),
`content: null` in the role chunk (OpenAI sends ""), its native /completion and /tokenize,
`timings`, its CORS defaults, `authentication_error` as the 401's type (OpenAI's is
invalid_request_error). Prints one line per test and the pass count.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUBSET = [
    "unit/test_chat_completion.py::test_chat_completion_stream",
    "unit/test_chat_completion.py::test_chat_completion_with_openai_library",
    "unit/test_chat_completion.py::test_logprobs",
    "unit/test_chat_completion.py::test_logprobs_stream",
    "unit/test_chat_completion.py::test_invalid_chat_completion_req",
    "unit/test_completion.py::test_completion_with_openai_library",
    "unit/test_completion.py::test_completion_stream_with_openai_library",
    "unit/test_security.py::test_access_public_endpoint",
    "unit/test_security.py::test_incorrect_api_key",
    "unit/test_security.py::test_correct_api_key",
    "unit/test_security.py::test_openai_library_correct_api_key",
    "unit/test_security.py::test_cors_options",
    "unit/test_security.py::test_cors_origins_localhost_reflects",
    "unit/test_security.py::test_cors_origins_localhost_rejects",
]
FILES = ["unit/test_chat_completion.py", "unit/test_completion.py", "unit/test_security.py"]
SDK_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "gpt-3.5-turbo", "davinci-002")
ROUTES = {"/chat/completions": "/v1/chat/completions", "/models": "/v1/models"}
LOOPBACK_ORIGINS = ("http://localhost", "http://127.0.0.1", "http://[::1]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gen_serve_args(server, model: str) -> list[str]:
    """The `gen serve` command line standing for llama-server with `server`'s settings."""
    slots = server.n_slots or 1
    args = [sys.executable, "-m", "cli.main", "serve", "--model", model, "--host", server.server_host,
            "--port", str(server.server_port), "--max-batch", str(slots)]
    if server.n_ctx:
        args += ["--max-context", str(max(2, server.n_ctx // slots))]
    if server.n_predict:
        args += ["--max-tokens-cap", str(server.n_predict)]
    if server.api_key:
        args += ["--api-key", server.api_key]
    for name in ((server.model_alias,) if server.model_alias else ()) + SDK_MODEL_NAMES:
        args += ["--served-model-name", name]
    if server.cors_origins:
        for origin in server.cors_origins.split(","):
            origins = LOOPBACK_ORIGINS if origin.strip() == "localhost" else (origin.strip(),)
            for o in origins:
                args += ["--cors-origin", o]
    return args


def patch(utils, model: str, log) -> None:
    """utils.ServerProcess starts gen serve; ServerPreset.load_all downloads nothing; the unversioned
    OpenAI routes go to /v1."""
    def start(self, timeout_seconds: int = 120) -> None:
        self.server_port = free_port()
        args = gen_serve_args(self, model)
        print("shim: starting", " ".join(args), file=log, flush=True)
        self.process = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                        stdout=log, stderr=subprocess.STDOUT)
        utils.server_instances.add(self)
        deadline = time.time() + timeout_seconds
        while time.time() < deadline:
            try:
                if self.make_request("GET", "/health").status_code == 200:
                    self.ready = True
                    return
            except Exception:   # noqa: BLE001 -- not listening yet
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"gen serve exited with {self.process.returncode}")
            time.sleep(0.05)
        raise TimeoutError(f"gen serve did not start within {timeout_seconds} s")

    original_url = utils.ServerProcess.make_url

    def make_url(self, path: str, host: str | None = None) -> str:
        return original_url(self, ROUTES.get(path, path), host)

    utils.ServerProcess.start = start
    utils.ServerProcess.make_url = make_url
    utils.ServerPreset.load_all = staticmethod(lambda: None)


def load_utils(path: Path):
    """The suite's utils.py, imported from its path and registered as `utils`, so that the suite's own
    `from utils import *` gets this module (patched below) rather than a second copy."""
    spec = importlib.util.spec_from_file_location("utils", path)
    utils = importlib.util.module_from_spec(spec)
    sys.modules["utils"] = utils
    spec.loader.exec_module(utils)
    return utils


class Report:
    """A pytest plugin: one line per test outcome."""

    def __init__(self):
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.nodeid] = report.outcome


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llama_cpp", help="a llama.cpp source checkout (its tools/server/tests are run)")
    ap.add_argument("--model", default="smollm2", help="the model gen serve loads (a chat model; default smollm2)")
    ap.add_argument("--all", action="store_true", help="every test of the three files, not only the subset")
    ap.add_argument("--log", default="llama_server_tests.log", help="gen serve's output goes here")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []   # more pytest arguments
    a = ap.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    tests = Path(a.llama_cpp) / "tools" / "server" / "tests"
    if not (tests / "utils.py").is_file():
        ap.error(f"{tests} holds no utils.py: give the root of a llama.cpp checkout")
    import pytest
    sys.modules.setdefault("wget", types.ModuleType("wget"))   # utils imports it for downloads only
    utils = load_utils(tests / "utils.py")
    log = open(a.log, "w")
    patch(utils, a.model, log)
    report = Report()
    selected = FILES if a.all else SUBSET
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tests), "-c", str(tests / "pytest.ini"),
                        *[str(tests / t) for t in selected], *extra], plugins=[report])
    passed = sorted(k for k, v in report.outcomes.items() if v == "passed")
    print(f"\n{len(passed)} of {len(report.outcomes)} passed (model {a.model}); gen serve's log: {a.log}")
    for nodeid, outcome in sorted(report.outcomes.items()):
        print(f"  {outcome:7s} {nodeid.split('tests/', 1)[-1]}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
