"""benchmarks/linear_card.py builds the model card's table from one JSON per cell: each quality cell is
divided by softmax's and by its control's (the rows on the `linear/` set by that set's own control), a
missing cell is '-', a task average needs all six tasks."""
from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import linear_card  # noqa: E402


def tasks(value: float) -> dict:
    return {"tasks": {t: {"metrics": {"acc_norm": {"value": 0.0}, "acc": {"value": 0.0}, m: {"value": value}}}
                      for t, m in linear_card.TASKS.items()}}


def write(d: Path, key: str, what: str, obj: dict) -> None:
    (d / f"{key}.{what}.json").write_text(json.dumps(obj))


def row(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith("| " + start))
    return [c.strip() for c in line.strip("|").split("|")]


def test_cells_against_softmax_and_control(tmp_path):
    write(tmp_path, "softmax", "tasks", tasks(0.5))
    write(tmp_path, "control", "tasks", tasks(0.25))
    write(tmp_path, "control_linear", "tasks", tasks(0.4))
    write(tmp_path, "linear", "tasks", tasks(0.2))
    write(tmp_path, "default", "tasks", tasks(0.2))
    write(tmp_path, "hybrid8", "tasks", tasks(0.2))
    write(tmp_path, "softmax", "stories", {"perplexity": 10.0})
    write(tmp_path, "control", "stories", {"perplexity": 4.0})
    write(tmp_path, "control_linear", "stories", {"perplexity": 8.0})
    write(tmp_path, "linear", "stories", {"perplexity": 16.0})
    write(tmp_path, "linear", "pk2k", {"tasks": {"passkey": {"lengths": {"2048": {"correct": 3, "trials": 20}}}}})
    summary = {"rows": {"all linear, learned @ 32768": {"state_bytes": 3 * 2**20, "runs": [{"median_ms": 4.7},
                                                                                          {"median_ms": 4.5}]}}}
    (tmp_path / "decode.json").write_text(json.dumps(summary))
    text = linear_card.table(Namespace(out=str(tmp_path), decode=str(tmp_path / "decode.json")))
    print(text)
    cells = row(text, "all linear, learned")
    assert cells[1:7] == ["0.20"] * 6                       # the metric each task's papers quote
    assert cells[7] == "0.200 (0.40x / 0.50x)"              # the average, x softmax / x its control (the set's)
    assert cells[8] == "16.00 (1.60x / 2.00x)"              # stories perplexity
    assert row(text, "**the default**")[7] == "0.200 (0.40x / 0.80x)"   # the other rows: x `control`
    assert row(text, "hybrid, 8")[7] == "0.200 (0.40x / 0.50x)"         # a windowless hybrid runs the set too
    assert cells[9:] == ["-", "3/20", "-", "3.0 MiB", "4.5"]   # passkey 1k and 8k missing, 2k, state, best median
    assert row(text, "hybrid, 2")[7] == "-"                  # no cell, no number
    assert "general" not in text.splitlines()[0]             # a text nobody measured is no column


def test_run_points_the_rows_at_a_candidate_and_its_control(tmp_path, monkeypatch):
    """`run --linear-model DIR --control-linear-model CTL`: the rows that name smollm2-linear run DIR, the
    linear/ set's control row runs CTL (a candidate's ratios are against its own control), the rest unchanged."""
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return Namespace(returncode=1, stdout="")     # a failed cell: left for a rerun, nothing written
    monkeypatch.setattr(linear_card.subprocess, "run", fake_run)
    a = Namespace(out=str(tmp_path), rows="linear,control_linear,control", only="general", stories=None,
                  general="g.txt", legal=None, limit=100, threads=1, linear_model="cand", control_linear_model="ctl")
    linear_card.run(a)
    models = {cmd[cmd.index("--model") + 1] for cmd in calls}
    assert models == {"cand", "ctl", "smollm2-control"}, calls
    assert not list(tmp_path.glob("*.json"))
