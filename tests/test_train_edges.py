"""Edges of `gen train` an outside audit found: a resume that silently mixed settings (or was a traceback),
a failed run's tokenizer that later runs silently took, progress lines into a pipe nobody reads or a full
stdout, an --export that replaced another model's files, and an export skipped without a word."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from conftest import one_line_error, sentence_corpus
from engine.train import TrainArgs, train
from models.tokenizer import Tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "2", "--warmup", "1",
        "--vocab-size", "300", "-t", "1"]


def gen(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return sentence_corpus(tmp_path_factory.mktemp("data") / "text.txt", 300, seed=2)


@pytest.fixture(scope="module")
def run3(corpus, tmp_path_factory):
    """A run stopped at step 3 (of --steps 3), trained with TINY; tests resume copies of it."""
    out = tmp_path_factory.mktemp("runs") / "run3"
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 3)
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture
def run(run3, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run3, out)
    return out


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A tokenizer of 320 pieces, not the one run3 trained."""
    from conftest import generated_sentences
    return train_tokenizer(generated_sentences(seed=5), str(tmp_path_factory.mktemp("tok") / "t.model"), 320).path


# ---------------------------------------------------------------------- 1: a resume keeps the run's settings
@pytest.mark.parametrize("extra, words", [
    (["--lr", "0.1"], ["--lr 0.1", "--lr 0.003"]),
    (["--seed", "3"], ["--seed 3", "--seed 0"]),
    (["--dim", "64"], ["--dim 64", "--dim 32"]),                    # was a "size mismatch" traceback, exit 1
    (["--vocab-size", "320"], ["--vocab-size 320", "300 pieces"]),  # kept the old tokenizer silently
    (["--paths", "softmax"], ["--paths softmax", "--paths softmax,linear"]),
    (["--no-linear-rope"], ["--no-linear-rope", "--linear-rope"]),
], ids=["lr", "seed", "dim", "vocab_size", "paths", "linear_rope"])
def test_a_resume_that_changes_a_setting_is_refused(corpus, run, extra, words):
    before = (run / "checkpoint.pt").read_bytes()
    r = gen("train", "--train", corpus, "--out", run, *TINY, "--steps", 6, *extra)
    one_line_error(r, *words, "give a new --out")
    assert (run / "checkpoint.pt").read_bytes() == before     # neither trained on nor its args rewritten


def test_a_resume_on_other_text_is_refused(corpus, run, tmp_path):
    moved = tmp_path / "moved.txt"
    shutil.copyfile(corpus, moved)                            # the same text under another name: resumes
    r = gen("train", "--train", moved, "--out", run, *TINY, "--steps", 4)
    assert r.exit_code == 0 and "resumed from" in r.stdout and checkpoint(run)["step"] == 4, r.output
    moved.write_text(moved.read_text() + "\n<|endoftext|>\nA new document.\n")
    one_line_error(gen("train", "--train", moved, "--out", run, *TINY, "--steps", 6), f"--train {moved}",
                   "not the text")
    assert checkpoint(run)["step"] == 4


def test_more_steps_and_other_run_options_resume(corpus, run):
    r = gen("train", "--train", corpus, "--out", run, *TINY, "--steps", 5, "--save-every", 7, "--eval-every", 9,
            "--valid", corpus, "--eval-docs", 2)
    assert r.exit_code == 0 and "resumed from" in r.stdout and "at step 3" in r.stdout, r.output
    assert checkpoint(run)["step"] == 5


def test_a_tokenizer_other_than_the_runs_is_refused(corpus, run, other_tokenizer):
    one_line_error(gen("train", "--train", corpus, "--out", run, *TINY, "--steps", 6, "--tokenizer", other_tokenizer),
                   f"--tokenizer {other_tokenizer} differs from {run / 'tokenizer.model'}")
    r = gen("train", "--train", corpus, "--out", run, *TINY, "--steps", 4, "--tokenizer", run / "tokenizer.model")
    assert r.exit_code == 0 and checkpoint(run)["step"] == 4, r.output   # its own tokenizer, named: resumes


# ---------------------------------------------------------------------- 2: a failed run leaves no files
def test_a_bad_tokenizer_leaves_nothing_and_a_good_one_then_trains(corpus, tmp_path, other_tokenizer):
    garbage = tmp_path / "bin.bin"
    garbage.write_bytes(bytes(range(256)) * 4)
    out = tmp_path / "run"
    one_line_error(gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--tokenizer", garbage),
                   f"--tokenizer {garbage}", "not a SentencePiece model")
    assert not out.exists()
    out.mkdir()                                               # a directory the user made stays, empty
    one_line_error(gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--tokenizer", garbage),
                   "not a SentencePiece model")
    assert out.is_dir() and list(out.iterdir()) == []
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--tokenizer", other_tokenizer)
    assert r.exit_code == 0, r.output                         # was the garbage's error again, forever
    assert (out / "tokenizer.model").read_bytes() == Path(other_tokenizer).read_bytes()


def test_too_little_text_leaves_no_tokenizer(corpus, tmp_path, other_tokenizer):
    out = tmp_path / "run"
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--seq-len", 100000)
    assert r.exit_code == 2 and r.stderr.startswith("gen: error: ") and "fewer than one window" in r.stderr
    assert "Traceback" not in r.output and not out.exists()   # the 300-piece tokenizer it trained is gone
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--tokenizer", other_tokenizer,
            "--export", tmp_path / "te")
    assert r.exit_code == 0, r.output
    assert Tokenizer(tmp_path / "te" / "tokenizer.model").vocab_size == 320   # exported vocab 300 before


# ---------------------------------------------------------------------- 3: stdout
def lines_that_fail(after: int):
    """A log whose line number `after` (0-based) and later fail as a pipe nobody reads does."""
    seen = []

    def log(line):
        seen.append(line)
        if len(seen) > after:
            raise BrokenPipeError(32, "Broken pipe")
    return log, seen


def test_a_reader_that_left_stops_the_run_at_a_saved_step(corpus, run3, tmp_path):
    """The eval line of step 2 cannot be written: step 2 is saved, no later step runs, the error is raised."""
    out = tmp_path / "run"
    a = TrainArgs(train=str(corpus), valid=str(corpus), out=str(out), vocab_size=300, dim=32, layers=1, heads=2,
                  seq_len=16, batch_size=2, steps=6, warmup=1, eval_every=2, eval_docs=2, save_every=10,
                  progress=False, amp=None, tokenizer=str(run3 / "tokenizer.model"), export=str(tmp_path / "te"))
    log, seen = lines_that_fail(after=2)                     # corpus, model, then the step-2 eval line
    with pytest.raises(BrokenPipeError):
        train(a, log=log)
    assert seen[-1].startswith("step 2 ") and checkpoint(out)["step"] == 2 and not (tmp_path / "te").exists()
    model = train(a, log=lambda line: None)                  # the same command again finishes it
    assert checkpoint(out)["step"] == 6 and (tmp_path / "te" / "config.json").exists() and model is not None


def run_gen(out: Path, corpus, stdout, *extra):
    """`gen train` in a subprocess, its stdout the given descriptor or file."""
    code = "import sys; from cli.main import main; sys.argv = ['gen'] + sys.argv[1:]; main()"
    cmd = [sys.executable, "-c", code, "train", "--train", str(corpus), "--out", str(out), *TINY, *map(str, extra)]
    return subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)


@pytest.mark.skipif(not (os.path.exists("/dev/full") and stat.S_ISCHR(os.lstat("/dev/full").st_mode)),
                    reason="no /dev/full character device")
def test_a_full_stdout_is_one_line_and_keeps_the_checkpoint(corpus, run3, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run3, out)
    with open("/dev/full", "w") as full:
        r = run_gen(out, corpus, full, "--steps", 6)        # was an OSError traceback
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)
    print(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["gen: error: cannot write to stdout: No space left on device"]
    assert checkpoint(out)["step"] == 3                       # kept (saved again where the run stopped)


def test_a_pipe_nobody_reads_stops_quietly_at_a_saved_checkpoint(corpus, tmp_path):
    """`gen train ... | head -0`: was exit 1 with nothing saved; now the run stops at a saved step, quietly,
    exit 1 (as cat, and every command's stdout, does) and the same command again resumes it."""
    out = tmp_path / "run"
    read, write = os.pipe()
    os.close(read)
    try:
        r = run_gen(out, corpus, write, "--steps", 2, "--export", tmp_path / "te")
    finally:
        os.close(write)
    print(r.stderr)
    assert r.returncode == 1 and r.stderr == ""
    assert checkpoint(out)["step"] == 0 and (out / "tokenizer.model").exists()


# ---------------------------------------------------------------------- 4: --export and another model
def test_export_into_another_model_is_refused_before_training(corpus, tmp_path):
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "README.md").write_text("the card of another model\n")
    (model_dir / "config.json").write_text("{}\n")
    out = tmp_path / "run"
    one_line_error(gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--export", model_dir),
                   f"--export {model_dir}", "README.md", "--force")
    assert not out.exists() and (model_dir / "config.json").read_text() == "{}\n"   # nothing trained, nothing touched
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--export", model_dir, "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 2, "--export", model_dir)
    assert r.exit_code == 0 and "exported step 2" in r.stdout, r.output   # this run's own export: rewritten


@pytest.mark.parametrize("where", ["file", "out"])
def test_export_that_is_no_model_directory_is_refused(corpus, tmp_path, where):
    out = tmp_path / "run"
    target = tmp_path / "f.txt" if where == "file" else out
    if where == "file":
        target.write_text("x\n")
    one_line_error(gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 1, "--export", target),
                   "--export", str(target))
    assert not out.exists()


# ---------------------------------------------------------------------- 5: no export skipped silently
def test_a_finished_checkpoint_is_exported(corpus, run, tmp_path):
    r = gen("train", "--train", corpus, "--out", run, *TINY, "--steps", 2, "--export", tmp_path / "te")
    assert r.exit_code == 0, r.output                         # was exit 0, nothing written, no word
    assert "already at step 3 (--steps 2): nothing to train" in r.stdout and "exported step 3" in r.stdout
    assert (tmp_path / "te" / "model.safetensors").exists() and checkpoint(run)["step"] == 3


def test_steps_0_saves_and_exports_the_initial_model(corpus, tmp_path, run3):
    out = tmp_path / "run"
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 0, "--export", tmp_path / "te",
            "--tokenizer", run3 / "tokenizer.model")
    assert r.exit_code == 0 and "--steps 0: nothing to train" in r.stdout, r.output
    assert checkpoint(out)["step"] == 0 and (tmp_path / "te" / "model.safetensors").exists()


def test_stop_after_says_the_export_waits(corpus, tmp_path, run3):
    out = tmp_path / "run"
    r = gen("train", "--train", corpus, "--out", out, *TINY, "--steps", 3, "--stop-after", 1,
            "--export", tmp_path / "te", "--tokenizer", run3 / "tokenizer.model")
    assert r.exit_code == 0 and "stopped at step 1 of 3" in r.stdout, r.output
    assert not (tmp_path / "te").exists()
