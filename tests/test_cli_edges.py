"""Edges of the command line an outside audit found: help into a full stdout, an empty --softmax-layers,
llama.cpp's short flags on every subcommand, a subcommand's usage hint, a misspelled subcommand."""
from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cli.main import echoing_stdout, main
from conftest import one_line_error
from engine.errors import InvalidArgumentError


def gen(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_gen(*args, stdout):
    """The installed `gen` in a subprocess, its stdout the given descriptor or file."""
    exe = str(Path(sys.executable).parent / "gen")
    if not os.path.exists(exe):
        pytest.skip("the `gen` console script is not installed (pip install -e .)")
    return subprocess.run([exe, *map(str, args)], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)


# ---------------------------------------------------------------------- 1: help and --version into a full stdout
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["serve", "--help"]])   # (every command's help: one path)
def test_help_into_a_full_stdout_is_one_line(args):
    with open("/dev/full", "w") as full:
        proc = run_gen(*args, stdout=full)
    print(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["gen: error: cannot write to stdout: No space left on device"]


def test_help_into_a_pipe_nobody_reads_is_quiet():
    """`gen --help | head -0`: the reader left; no traceback, no line (exit 1, as click and cat do)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = run_gen("generate", "--help", stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 1 and proc.stderr == ""


def test_only_stdout_is_called_stdout(monkeypatch):
    """Another file's full disk is not reported as stdout's."""
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    def raised(**kwargs):
        try:
            click.echo("x", **kwargs)
        except OSError as e:
            return e
    assert not echoing_stdout(raised(file=Full()))
    assert not echoing_stdout(OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(sys, "stdout", Full())
    assert echoing_stdout(raised())


# ---------------------------------------------------------------------- 2: hybrid with no softmax layers
@pytest.mark.parametrize("layers", ["", "  ", ",", " , "])
def test_empty_softmax_layers_are_refused_on_the_command_line(small_model_dir, layers):
    one_line_error(gen("--model", small_model_dir, "--attention", "hybrid", "--softmax-layers", layers, "-n", 1, "hi"),
                   "--softmax-layers", "names no layer", "2,9,11", "auto:K")
    one_line_error(gen("--model", small_model_dir, "--softmax-layers", layers, "-n", 1, "hi"), "names no layer")


@pytest.mark.parametrize("layers", [[], (), "", "  ", ","])
def test_empty_softmax_layers_are_refused_by_the_api(small_model_dir, layers):
    from engine.api import load
    with pytest.raises(InvalidArgumentError, match="names no layer.*2,9,11 or auto:K"):
        load(str(small_model_dir), attention="hybrid", softmax_layers=layers)


def test_listed_softmax_layers_still_run(small_model_dir):
    r = gen("--model", small_model_dir, "--attention", "hybrid", "--softmax-layers", "1,", "-n", 1, "hi")
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------------- 3: short flags; the subcommand's help named
def test_eval_takes_m_and_t(monkeypatch, tmp_path):
    import cli.eval
    calls = []
    monkeypatch.setattr(cli.eval, "perplexity", lambda *a: calls.append(a))
    r = gen("eval", "-m", "some-model", "-t", 1, "--data", tmp_path / "corpus.txt")
    assert r.exit_code == 0, r.output
    (model_name, *_, threads, as_json, sparse_keys), = calls
    assert model_name == "some-model" and threads == 1


def test_serve_takes_m_and_t(monkeypatch):
    import cli.serve
    calls = []
    monkeypatch.setattr(cli.serve, "check_listen", lambda host, port: None)   # port 8000 may be taken here
    monkeypatch.setattr(cli.serve, "open_server", lambda *a, **k: calls.append(a) or "server")
    monkeypatch.setattr(cli.serve, "run", lambda server, **k: None)
    r = gen("serve", "-m", "some-model", "-t", 1)
    assert r.exit_code == 0, r.output
    model_name, attention, feature_map, dtype, backend, threads, *_ = calls[0]
    assert model_name == "some-model" and threads == 1


@pytest.mark.parametrize("command", ["generate", "eval", "serve", "bench", "chat", "linearize"])
def test_model_and_threads_have_short_flags(command):
    opts = {o: p.name for p in main.get_command(None, command).params for o in p.opts}
    assert opts["-m"] == "model_name" and opts["-t"] == "threads"


def test_train_keeps_its_t():
    opts = {o: p.name for p in main.commands["train"].params for o in p.opts}
    assert opts["-t"] == "threads"


@pytest.mark.parametrize("command", ["eval", "serve", "chat", "bench"])
def test_a_usage_error_names_the_subcommands_help(command):
    one_line_error(gen(command, "--no-such-flag"), "No such option", f"(see gen {command} --help)")


def test_a_bad_option_of_gen_itself_points_at_generates_help():
    one_line_error(gen("--no-such-flag", "hi"), "(see gen generate --help)")


# ---------------------------------------------------------------------- 4: a misspelled subcommand
@pytest.fixture
def prompts(monkeypatch):
    """What generation was asked for, without running it."""
    seen = []
    monkeypatch.setattr(main.commands["generate"], "callback", lambda **kw: seen.append((kw["prompt"], kw["prompt_opt"])))
    return seen


@pytest.mark.parametrize("word,command", [("bnech", "bench"), ("Bench", "bench"), ("evla", "eval"), ("sevre", "serve"),
                                          ("bnch", "bench"), ("linarize", "linearize")])
def test_a_near_subcommand_name_gets_a_note(prompts, word, command):
    r = gen(word)
    assert r.exit_code == 0, r.output
    assert r.stderr.strip().splitlines() == [f'gen: note: generating from the prompt "{word}"; for the command, '
                                             f'gen {command}']
    assert prompts == [(word, None)]


@pytest.mark.parametrize("args", [["hello"], ["--", "bnech"], ["--prompt", "bnech"], ["bnech", "-n", "1"],
                                  ["bnech bench"], ["what"], ["cat"], ["cheat"], ["rain"], ["beach"], ["veal"],
                                  ["evil"], ["server"], ["nerve"]])   # words a prompt is made of
def test_other_prompts_get_no_note(prompts, args):
    r = gen(*args)
    assert r.exit_code == 0, r.output
    assert "note" not in r.stderr and len(prompts) == 1


# ---------------------------------------------------------------------- 5: the server's stack only for gen serve
def test_the_server_stack_is_imported_only_for_serve():
    """`gen serve` is loaded when named (cli.main.LAZY_COMMANDS): FastAPI, pydantic, uvicorn and
    sse-starlette took ~0.5 s of every other command's ~2.6 s start. `gen --help` still lists it, and
    `gen serve` parses as before (test_a_usage_error_names_the_subcommands_help)."""
    code = ("import sys; from cli.main import main; import click\n"
            "stack = ('fastapi', 'uvicorn', 'pydantic', 'sse_starlette', 'engine.serve')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in stack or m.startswith('engine.serve')))\n"
            "print('serve' in main.list_commands(None), main.get_command(None, 'serve').name)\n"
            "print('uvicorn' in sys.modules, 'pydantic' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "True serve", "True True"]
    helped = gen("--help")
    assert helped.exit_code == 0 and "  serve " in helped.output
