"""How the native step is built (engine/steps/native/build.py): every source compiled on its own
compiler process, at once; one link; concurrent builders of one library wait for the first instead of
compiling again; a failure leaves nothing behind. A stand-in compiler logs each call and compiles an
empty file instead of the source (the real build is what every native test loads: compiled by the first
process of the run, or by `gen` into its own cache from the same sources: tests/conftest.py)."""
from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.steps.native import build as native_build
from engine.steps.native.build import SOURCES, NativeUnavailableError

REAL_CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(REAL_CC is None, reason="needs a C compiler (cc or gcc) on PATH")

FAKE_CC = """#!{python}
import os, subprocess, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(f"{{time.time():.3f}} {{os.getpid()}} " + " ".join(args) + "\\n")
if "-c" in args:
    src = args[-1]
    if os.path.basename(src) == os.environ.get("FAKE_CC_FAIL"):
        sys.stderr.write(src + ":1:1: error: made to fail\\n")
        sys.exit(1)
    barrier = os.environ.get("FAKE_CC_BARRIER")
    if barrier:   # wait (10 s at most) until a second compile has started: only compiles at once pass
        open(os.path.join(barrier, f"started-{{os.getpid()}}"), "w").close()
        deadline = time.time() + 10
        while len(os.listdir(barrier)) < 2 and time.time() < deadline:
            time.sleep(0.01)
        if len(os.listdir(barrier)) < 2:
            with open({log!r}, "a") as f:
                f.write(f"{{time.time():.3f}} {{os.getpid()}} ALONE " + src + "\\n")
    time.sleep(0.2)
    out = args[args.index("-o") + 1]
    sys.exit(subprocess.run([{cc!r}, "-x", "c", "-c", "-o", out, "/dev/null"]).returncode)
sys.exit(subprocess.run([{cc!r}, *args]).returncode)
"""


@pytest.fixture
def fake_cc(tmp_path):
    log = tmp_path / "cc.log"
    cc = tmp_path / "fake-cc"
    cc.write_text(FAKE_CC.format(python=sys.executable, log=str(log), cc=REAL_CC))
    cc.chmod(0o755)
    return str(cc), log


def calls(log: Path) -> list[tuple[float, list[str]]]:
    out = []
    for line in log.read_text().splitlines():
        t, _pid, *args = line.split(" ")
        out.append((float(t), args))
    return out


def test_each_source_compiles_once_on_its_own_process_then_one_link(fake_cc, tmp_path, monkeypatch):
    cc, log = fake_cc
    monkeypatch.setattr(native_build, "_cores", lambda: 4)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    monkeypatch.setenv("FAKE_CC_BARRIER", str(barrier))
    lib = tmp_path / "cache" / "decode-x.so"
    native_build.build(cc, lib)
    assert lib.exists()
    got = calls(log)
    # at once: the first compile waited for a second to start (a build one source at a time would not)
    assert not [a for _, a in got if "ALONE" in a], "a compile ran alone"
    got = [(t, a) for t, a in got if "ALONE" not in a]
    compiles = [a for _, a in got if "-c" in a]
    assert sorted(Path(a[-1]).name for a in compiles) == sorted(SOURCES)
    assert all("-shared" not in a and "-O3" in a and "-march=native" in a for a in compiles)
    (link,) = [a for _, a in got if "-c" not in a]
    assert "-shared" in link and link[-1] == "-lm" and sum(x.endswith(".o") for x in link) == len(SOURCES)
    assert sorted(p.name for p in lib.parent.iterdir()) == ["decode-x.lock", "decode-x.so"]


def test_concurrent_builders_compile_once(fake_cc, tmp_path):
    cc, log = fake_cc
    lib = tmp_path / "cache" / "decode-x.so"
    errors = []

    def builder():
        try:
            native_build.build(cc, lib)
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert not errors and lib.exists()
    compiles = [a for _, a in calls(log) if "-c" in a]
    assert len(compiles) == len(SOURCES), "a builder compiled again instead of waiting for the first"


def test_a_failed_compile_is_one_line_and_leaves_nothing(fake_cc, tmp_path, monkeypatch):
    cc, log = fake_cc
    monkeypatch.setenv("FAKE_CC_FAIL", "qdot.c")
    lib = tmp_path / "cache" / "decode-x.so"
    with pytest.raises(NativeUnavailableError, match=r"^compiling the native step with .* failed: .*qdot.c:1:1: error: made to fail$"):
        native_build.build(cc, lib)
    assert [p.name for p in lib.parent.iterdir()] == ["decode-x.lock"]   # no library, no build directory
    assert not any("-c" not in a for _, a in calls(log)), "linked after a failed compile"


def test_a_cache_that_fails_midway_or_has_no_locks(fake_cc, tmp_path, monkeypatch):
    """An OSError inside the build (here the final rename) is NativeUnavailableError (the step falls back
    to PyTorch), leaving nothing; a file system without locks (flock fails) builds without waiting."""
    cc, _ = fake_cc
    lib = tmp_path / "cache" / "decode-x.so"
    real_replace = native_build.os.replace

    def full(a, b):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(native_build.os, "replace", full)
    with pytest.raises(NativeUnavailableError, match="cannot write the native step's build cache .*No space left"):
        native_build.build(cc, lib)
    assert [p.name for p in lib.parent.iterdir()] == ["decode-x.lock"]
    monkeypatch.setattr(native_build.os, "replace", real_replace)

    def no_locks(f, op):
        raise OSError(37, "No locks available")
    monkeypatch.setattr(native_build.fcntl, "flock", no_locks)
    native_build.build(cc, lib)
    assert lib.exists()


def test_a_cache_that_cannot_be_written_is_one_line(fake_cc, tmp_path):
    cc, _ = fake_cc
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NativeUnavailableError, match="cannot write the native step's build cache"):
        native_build.build(cc, blocker / "cache" / "decode-x.so")
