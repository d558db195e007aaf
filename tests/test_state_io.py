"""Decoding states saved and restored (state_dict, llm.save_state/load_state, a new process), and the
batch operations continuous batching uses (concat, select_rows): identical tokens, both paths."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import ROOT, check_regrouping_copies_rows_exactly, check_rows_join_and_leave, greedy, tiny_model
from engine.api import load
from engine.errors import CheckpointError, EngineError, StateMismatchError
from engine.steps import Stepper

PATHS = ["softmax", "linear"]


@pytest.mark.parametrize("path", PATHS)
def test_state_dict_round_trip_continues_identically(path):
    model = tiny_model(seed=1)
    step = Stepper(model, "torch")
    prompt = torch.tensor([[1, 5, 9, 20, 3, 7]])
    a = model.init_state(1, 64, attention=path)
    logits = step(prompt, a, last_only=True)[:, -1]
    sd = a.state_dict()
    b = type(a).from_state_dict(sd, max_len=64)
    assert sd["meta"]["slots"] == 6 and sd["meta"]["path"] == path
    nxt = logits.argmax(-1)[:, None]
    assert torch.equal(step(nxt, a.select_rows([0])), step(nxt, type(a).from_state_dict(sd, max_len=64)))
    assert greedy(step, b, logits, 12) == greedy(step, a, logits, 12)


@pytest.mark.parametrize("path", PATHS)
def test_load_state_dict_refuses_another_shape(path):
    sd = tiny_model(seed=1).init_state(1, 32, attention=path).state_dict()
    other = tiny_model(seed=1, num_hidden_layers=3).init_state(1, 32, attention=path)
    with pytest.raises(StateMismatchError, match="layers"):
        other.load_state_dict(sd)
    with pytest.raises(StateMismatchError, match="batch|sequences"):
        tiny_model(seed=1).init_state(2, 32, attention=path).load_state_dict(sd)


@pytest.mark.parametrize("path", PATHS)
def test_concat_and_select_rows_keep_every_row_as_it_is_alone(path):
    """Rows prefilled alone (different lengths), joined into one batch at different times, dropped
    as they finish: each row's greedy tokens equal its solo run (KV rows right-aligned, pads masked)."""
    model = tiny_model(seed=1)
    step = Stepper(model, "torch")
    check_rows_join_and_leave(step, lambda max_len: model.init_state(1, max_len, attention=path))


@pytest.mark.parametrize("path", PATHS)
def test_select_rows_copies_scattered_rows_exactly(path):
    model = tiny_model(seed=1)
    check_regrouping_copies_rows_exactly(Stepper(model, "torch"), lambda max_len: model.init_state(1, max_len, attention=path))


def test_concat_masks_the_pad_slots_of_a_shorter_row():
    model = tiny_model(seed=1)
    a, b = model.init_state(1, 16, attention="softmax"), model.init_state(1, 16, attention="softmax")
    model.step(torch.tensor([[1, 2, 3, 4, 5]]), a)
    model.step(torch.tensor([[1, 2]]), b)
    both = type(a).concat([a, b])
    assert both.slots == 5 and both.padded
    assert both.slot_real[1, :5].tolist() == [False, False, False, True, True]
    assert both.lengths.tolist() == [5, 2]
    alone = both.select_rows([1])
    assert alone.slots == 2 and not alone.padded          # the pads no kept row needs are trimmed


RESUME = """
import json, sys
from engine.api import load
model_dir, cases = sys.argv[1], json.loads(sys.argv[2])
for path, state_file, settings in cases:
    llm = load(model_dir, attention=path, backend="torch")
    print(json.dumps(llm.resume(llm.load_state(state_file), **settings).run()[0].ids))
"""
SAMPLINGS = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.9, seed=11, top_k=40)}


def test_saved_state_restored_in_a_new_process_continues_identically(small_model_dir, tmp_path):
    """Both paths, greedy and seeded: one new process resumes every saved state (one start-up)."""
    prompt, cases, want = "the cat sat on a mat and then", [], []
    for path in PATHS:
        llm = load(str(small_model_dir), attention=path, backend="torch")
        for name, sampling in SAMPLINGS.items():
            settings = dict(max_new_tokens=20, ignore_eos=True, **sampling)
            want.append(llm.generate(prompt, **settings).ids)
            state_file = tmp_path / f"{path}-{name}.safetensors"
            llm.save_state(state_file, llm.prefill(prompt))
            cases.append((path, str(state_file), settings))
    assert not list(tmp_path.glob("*.tmp"))
    out = subprocess.run([sys.executable, "-c", RESUME, str(small_model_dir), json.dumps(cases)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.strip().splitlines()[-len(cases):]] == want


@pytest.mark.parametrize("path", PATHS)
def test_resume_with_more_tokens_equals_the_whole_prompt(small_model_dir, small_tokenizer, path, tmp_path):
    llm = load(str(small_model_dir), attention=path, backend="torch")
    first, more = small_tokenizer.encode("the dog ran", bos=True), small_tokenizer.encode("home and")
    want = llm.generate(first + more, max_new_tokens=10, temperature=0, ignore_eos=True).ids
    llm.save_state(tmp_path / "s.safetensors", llm.prefill(first))
    got = llm.resume(llm.load_state(tmp_path / "s.safetensors"), more, max_new_tokens=10, temperature=0,
                     ignore_eos=True).run()[0].ids
    assert got == want


def test_a_state_from_another_model_is_refused(small_model_dir, tmp_path):
    llm = load(str(small_model_dir), attention="softmax", backend="torch")
    llm.save_state(tmp_path / "s.safetensors", llm.prefill([1, 5, 6]))
    from engine.api import LLM
    other_weights = LLM(tiny_model(seed=9, vocab_size=llm.model.config.vocab_size, max_position_embeddings=64),
                        llm.tokenizer, backend="torch")
    with pytest.raises(StateMismatchError, match="another model"):
        other_weights.load_state(tmp_path / "s.safetensors")
    other_shape = LLM(tiny_model(seed=3, num_hidden_layers=3), None, backend="torch")
    with pytest.raises(StateMismatchError, match="configuration"):
        other_shape.load_state(tmp_path / "s.safetensors")
    with pytest.raises(StateMismatchError, match="the state is another model's"):   # in memory: the run is the same
        other_shape.resume(llm.prefill([1, 5, 6]))
    linear = load(str(small_model_dir), attention="linear", backend="torch")
    with pytest.raises(StateMismatchError, match="of a softmax run; this LLM runs linear"):
        linear.load_state(tmp_path / "s.safetensors")


@pytest.mark.parametrize("made, runs", [
    (dict(attention="linear", window=4), dict(attention="linear", window=8)),
    (dict(attention="linear", window=4), dict(attention="linear")),
    (dict(attention="linear", window=4, sparse_keys=2), dict(attention="linear", window=4)),
    (dict(attention="hybrid", softmax_layers=[1]), dict(attention="hybrid", softmax_layers=[0])),
    (dict(attention="softmax"), dict(attention="linear")),
], ids=["window-4-8", "window-none", "sparse-keys", "hybrid-layers", "softmax-linear"])
def test_a_state_of_another_run_is_refused(small_model_dir, tmp_path, made, runs):
    """A state decodes as the run that made it: resumed by an LLM of another run (another window, softmax
    layer, sparse cache) it answered as that run, whatever the LLM was loaded as."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # hybrids of the small model: UntrainedPathWarning
        maker = load(str(small_model_dir), backend="torch", **made)
        other = load(str(small_model_dir), backend="torch", **runs)
    with pytest.raises(StateMismatchError, match="the state is of a .* run; this LLM runs"):
        other.resume(maker.prefill([1, 5, 6]))
    maker.save_state(tmp_path / "s.safetensors", maker.prefill([1, 5, 6]))
    with pytest.raises(StateMismatchError, match="load the model with the options the state was made with"):
        other.load_state(tmp_path / "s.safetensors")
    assert len(maker.resume(maker.load_state(tmp_path / "s.safetensors"), max_new_tokens=2).run()[0].ids) == 2


def test_misused_state_calls_are_one_typed_error(small_model_dir, tmp_path):
    llm = load(str(small_model_dir), backend="torch")
    for call, what in ((lambda: llm.resume(None), "resume\\(\\): expected a SavedState"),
                       (lambda: llm.save_state(tmp_path / "x.st", "abc"), "save_state\\(\\): expected a SavedState"),
                       (lambda: llm.prefill([1, 5], max_len="x"), "max_len must be a whole number"),
                       (lambda: llm.prefill([1, 5], max_len=-1), "max_len must be a whole number"),
                       (lambda: llm.load_state(tmp_path / "none.st"), "no such file"),
                       (lambda: llm.load_state(tmp_path / "none.st", max_len=0), "max_len must be")):
        with pytest.raises(EngineError, match=what):
            call()


def test_a_file_that_is_not_a_state_is_refused(small_model_dir, tmp_path):
    llm = load(str(small_model_dir), backend="torch")
    with pytest.raises(CheckpointError, match="not a saved decoding state"):
        llm.load_state(small_model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="is a directory; give the file llm.save_state"):
        llm.load_state(tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file at all")
    with pytest.raises(CheckpointError):
        llm.load_state(tmp_path / "junk.safetensors")


def test_saving_through_a_link_keeps_the_link_and_other_files(small_model_dir, tmp_path):
    """A state saved to a symbolic link writes its target (the link stays a link), a FILE.tmp of the
    user's is left alone, and a directory or a missing folder is one CheckpointError line."""
    llm = load(str(small_model_dir), backend="torch")
    saved = llm.prefill([1, 5, 6])
    target = tmp_path / "kept" / "s.safetensors"
    target.parent.mkdir()
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    (tmp_path / "link.safetensors.tmp").write_text("mine")
    llm.save_state(link, saved)
    assert link.is_symlink() and target.is_file()
    assert (tmp_path / "link.safetensors.tmp").read_text() == "mine"
    assert llm.load_state(link).ids == saved.ids
    assert sorted(p.name for p in target.parent.iterdir()) == ["s.safetensors"]   # no temporary left
    with pytest.raises(CheckpointError, match="is a directory; give a file path"):
        llm.save_state(tmp_path, saved)
    with pytest.raises(CheckpointError, match="cannot write .*nowhere/s.safetensors: No such file"):
        llm.save_state(tmp_path / "nowhere" / "s.safetensors", saved)
