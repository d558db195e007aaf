"""Files `gen bench` writes where the user says (--json, --plot), and its memory check before measuring.

A regular file is replaced whole; a symbolic link is followed (its target replaced, the link kept); a
device or FIFO is written in place, never renamed over; a write that fails is one line after the table.
"""
from __future__ import annotations

import json
import os
import stat
import threading

import pytest
import torch

from engine.bench.memory import run_bytes
from test_first_contact import gen, one_line_error, run_gen
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("small_copy_buffer")   # tests/conftest.py: the floor is not checked here

SMALL = ("bench", "--model", "tiny", "--contexts", 8, "--steps", 1, "--warmup", 0, "--no-isolate", "--quiet",
         "--threads", 1, "--attention", "linear", "--backend", "torch")


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old\n")
    link.symlink_to(real.name)
    plot_real, plot_link = tmp_path / "plots" / "real.png", tmp_path / "link.png"
    plot_real.parent.mkdir()
    plot_link.symlink_to(plot_real)   # a target in another directory, not there yet
    r = gen(*SMALL, "--json", link, "--plot", plot_link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == "real.json"
    assert json.loads(real.read_text())["results"][0]["context"] == 8
    assert plot_link.is_symlink() and plot_real.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "link.png", "plots", "real.json"]
    assert os.listdir(plot_real.parent) == ["real.png"]   # no temporary left beside either target


def test_a_fifo_gets_the_json_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    r = gen(*SMALL, "--json", fifo)
    reader.join(timeout=60)
    assert r.exit_code == 0, r.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced"
    assert got and json.loads(got[0])["results"][0]["attention"] == "linear"
    assert os.listdir(tmp_path) == ["fifo.json"]


@pytest.mark.parametrize("how", ["a link to /proc/self/fd/1, as /dev/stdout is", "stdout's own name"])
def test_stdout_s_own_file_gets_the_json_then_the_table(tmp_path, how):
    """`--json /dev/stdout > out.txt`: written through stdout, not renamed over out.txt (which would leave
    the table that follows in a file no name reaches)."""
    out = tmp_path / "out.txt"
    target = out
    if how.startswith("a link"):
        target = tmp_path / "stdout.json"
        target.symlink_to("/proc/self/fd/1")   # resolved by the gen process: its own stdout
    with open(out, "w") as f:
        proc = run_gen(*SMALL, "--json", target, stdout=f)
    assert proc.returncode == 0, proc.stderr
    report, end = json.JSONDecoder().raw_decode(out.read_text())
    assert report["results"][0]["context"] == 8
    assert "linear (elu1)" in out.read_text()[end:]
    assert sorted(os.listdir(tmp_path)) == sorted({"out.txt", target.name})


@pytest.mark.skipif(not (os.path.exists("/dev/full") and stat.S_ISCHR(os.lstat("/dev/full").st_mode)),
                    reason="no /dev/full character device")
def test_dev_full_is_one_line_after_the_table_and_stays_a_device():
    r = gen(*SMALL, "--json", "/dev/full")
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode), "/dev/full is no longer a device: restore it " \
                                                        "(rm /dev/full; mknod -m 666 /dev/full c 1 7)"
    one_line_error(r, "/dev/full", "No space left on device", "table above")
    assert "linear (elu1)" in r.stdout   # the measurements the run made are still printed


def test_a_batch_beyond_memory_is_refused_before_measuring(monkeypatch):
    """The state and the prefill activations scale with --batch: a batch no machine holds is the one-line
    "needs N bytes ... this machine has M" refusal up front, not gigabytes allocated per context."""
    import engine.bench.sweep as sweep
    monkeypatch.setattr(sweep, "measure", lambda *a, **k: pytest.fail("ran a configuration before refusing"))
    r = gen("bench", "--model", "tiny", "--contexts", 16, "--steps", 2, "--batch", 10**7, "--quiet", "--threads", 1,
            "--no-isolate")
    one_line_error(r, "context 16", "at batch 10000000", "needs", "this machine has", "--batch")


def test_run_bytes_counts_the_batch():
    one, three = (run_bytes(tiny_config(), "softmax", 16, 26, torch.float32, 10**6, batch=b) for b in (1, 3))
    assert three["state"] == 3 * one["state"] and three["prefill"] == 3 * one["prefill"]
    assert three["weights"] == one["weights"]
