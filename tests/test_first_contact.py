"""What a new user meets first (issue 34): tracebacks, silent acceptance, chat defaults, habits."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from engine.api import load


def gen(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_line_error(r, *words, code=2):
    print(repr(r.stderr))
    assert r.exit_code == code and "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: error: ")
    for w in words:
        assert w in lines[0]
    return lines[0]


# ---------------------------------------------------------------------- item 3: tracebacks
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantized_torch_step_in_a_16_bit_dtype(small_model_dir, dtype):
    """--backend torch --quantize q8_0 --dtype bfloat16 (the README's "every choice explicit" line) runs,
    and its torch step agrees with the module path on the same quantized weights."""
    prompt = "the cat sat"
    got = load(str(small_model_dir), backend="torch", quantize="q8_0", dtype=dtype).generate(
        prompt, temperature=0, max_new_tokens=8)
    ref = load(str(small_model_dir), backend="module", quantize="q8_0", dtype=dtype).generate(
        prompt, temperature=0, max_new_tokens=8)
    assert got.stats.step_form == "torch" and got.ids == ref.ids
    r = gen("--model", small_model_dir, "--backend", "torch", "--quantize", "q8_0", "--dtype", dtype,
            "--max-new-tokens", 4, prompt)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output


def run_gen(*args, stdin=None, stdout=None, close=(), timeout=120):
    """The installed `gen` in a subprocess; close: file descriptors to close in the child first (0, 1)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    exe = str(Path(sys.executable).parent / "gen")
    if not os.path.exists(exe):
        pytest.skip("the `gen` console script is not installed (pip install -e .)")

    def closing():
        for fd in close:
            os.close(fd)
    return subprocess.run([exe, *map(str, args)], stdin=stdin, stdout=stdout or subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, preexec_fn=closing)


def check_one_line(proc, *words, code=2):
    print(proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and "Traceback" not in proc.stderr and len(lines) == 1
    assert lines[0].startswith("gen: error: ") and all(w in lines[0] for w in words)


def test_closed_stdin_is_one_line(small_model_dir, tmp_path):
    from chat_fixtures import bpe_model_dir
    check_one_line(run_gen("--model", small_model_dir, "-", close=(0,)), "stdin is closed")
    chat_dir = bpe_model_dir(tmp_path / "chat")
    check_one_line(run_gen("chat", "--model", chat_dir, close=(0,)), "stdin is closed")


def test_closed_stdout_is_one_line(small_model_dir):
    check_one_line(run_gen("--model", small_model_dir, "--max-new-tokens", 4, "the cat", close=(1,)),
                   "stdout is closed")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("json_out", [False, True], ids=["stream", "json"])
def test_full_stdout_is_one_line(small_model_dir, json_out):
    with open("/dev/full", "w") as full:
        proc = run_gen("--model", small_model_dir, "--max-new-tokens", 4, *(["--json"] if json_out else []),
                       "the cat", stdout=full)
    check_one_line(proc, "cannot write to stdout", "No space left")


def test_lone_surrogate_is_a_typed_error(small_model_dir):
    from engine.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match=r"generate\(\): the prompt is not valid UTF-8.*U\+D800"):
        load(str(small_model_dir)).generate("\ud800", max_new_tokens=2)
    one_line_error(gen("--model", small_model_dir, "ab\udfffc"), "U+DFFF")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full on this system")
def test_chat_into_a_full_stdout_is_one_line(tmp_path):
    from chat_fixtures import bpe_model_dir
    chat_dir = bpe_model_dir(tmp_path / "chat")
    (tmp_path / "in.txt").write_text("hello there\n")
    with open("/dev/full", "w") as full, open(tmp_path / "in.txt") as lines:
        proc = run_gen("chat", "--model", chat_dir, "--max-new-tokens", 8, "--seed", 0, stdin=lines, stdout=full)
    print(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "gen: error: cannot write to stdout: No space left on device" in proc.stderr.splitlines()
