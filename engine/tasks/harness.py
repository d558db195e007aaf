"""Tasks on one configuration, and their results kept per configuration on disk.

    conf = configuration(llm, model="smollm2", dtype="float32", quantize=None, context=None)
    store = ResultStore("results/", conf)               # results/<readable name>-<hash>.json
    store.get("piqa", {"limit": 100})                   # a finished result with these settings, or None
    res = run_lm_eval_task(llm, "piqa", yaml_path, limit=100)
    store.put("piqa", {"limit": 100}, res)              # written at once (an interrupted grid resumes)

`run_lm_eval_task` runs lm-eval's `simple_evaluate` on one task YAML (engine.tasks.data) with the
`gen` model (engine.tasks.adapter, which lm-eval imports by name when the run asks for it) and the
Hugging Face libraries offline, and keeps each metric with its standard error, the number of
documents scored, the time and the scorer's token counts.
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from unittest import mock

from engine.errors import InvalidArgumentError
from engine.tasks.scoring import ScoreStats
from models.hf_dir import MODEL_FILES
from models.registry import resolve
from models.replace import replacing

try:
    import fcntl
except ImportError:   # pragma: no cover (not POSIX: writers do not take turns)
    fcntl = None

BOOTSTRAP_ITERS = 1000   # lm-eval's bootstrap for the stderr of non-mean metrics (LAMBADA's perplexity)


SIGNATURE_READ = 1 << 22   # bytes read at a time for a weights file's signature


def weights_signature(model: str | os.PathLike) -> str | None:
    """What the files behind `model` (a registered name or a path; a linearized set's base model too)
    hold: each weights file's (_weights_file) name, size and sha256, whole (its first and last MiB alone
    missed a layer edited in the middle: ~0.1 s for SmolLM2's 98 MB here, once a run). Another model copied to
    the same path, a retrained export, an edited layer, a rewritten set: another signature,
    so a --results directory never hands back another model's scores under the same name (a model card
    or git's files changing do not count). None when it cannot be read."""
    h, seen = hashlib.sha256(), set()

    def add(path: Path, depth: int = 0) -> None:
        path = path.resolve()
        if path in seen or depth > 3:
            return
        seen.add(path)
        files = sorted(p for p in path.rglob("*") if p.is_file() and _weights_file(p.relative_to(path))) \
            if path.is_dir() else [path]
        for f in files:
            whole = hashlib.sha256()
            with open(f, "rb") as fh:
                while block := fh.read(SIGNATURE_READ):
                    whole.update(block)
            name = f.relative_to(path) if path.is_dir() else f.name
            h.update(f"{name}\0{f.stat().st_size}\0".encode() + whole.digest())
        config = path / "config.json"
        if config.is_file():
            base = json.loads(config.read_text(encoding="utf-8")).get("base_model")
            if isinstance(base, str):
                add(resolve(base), depth + 1)

    try:
        add(Path(resolve(model)))
    except (OSError, ValueError, json.JSONDecodeError):
        return None
    return h.hexdigest()[:16]


RECORDS = {"README.md", "linearize.json", "data.json", "*.safetensors.tmp", ".*.tmp"}   # model files a load does not read


def _weights_file(rel: Path) -> bool:
    """A file a load reads (a model directory's files, models.hf_dir.MODEL_FILES, less its records; in a
    variant's folder too), not a model card, a results directory kept inside the model's, git's or a
    hub's metadata (a dot folder)."""
    return not any(part.startswith(".") for part in rel.parts) and any(
        fnmatch.fnmatch(rel.name, pattern) for pattern in MODEL_FILES if pattern not in RECORDS)


def configuration(llm, model: str, dtype: str | None = None, quantize: str | None = None,
                  context: int | None = None) -> dict:
    """What decides a configuration's scores: model (its name and what its files hold: weights_signature),
    path per layer, window, feature map, dtype, quantization, context."""
    spec = llm.spec
    paths = list(spec.layer_paths(llm.model.config.num_hidden_layers))
    out = {"model": str(model), "attention": llm.attention,
           "softmax_layers": [i for i, p in enumerate(paths) if p == "softmax"] if llm.attention == "hybrid" else None,
           "window": spec.linear_window, "feature_map": llm.feature_map or (spec.feature_map if "linear" in paths
                                                                                  else None),
           "dtype": str(dtype or "float32"), "quantize": quantize, "context": context}
    if spec.linear_sparse_keys:   # named only when on: earlier results keep their file names
        out["sparse_keys"] = spec.linear_sparse_keys
    out["weights"] = weights_signature(model)
    return out


def slug(conf: dict) -> str:
    """A readable file name for a configuration, with a hash of all of it."""
    name = Path(conf["model"]).name or "model"
    parts = [name, conf["attention"]]
    if conf.get("softmax_layers") is not None:
        parts.append(f"{len(conf['softmax_layers'])}sm")
    if conf.get("window"):
        parts.append(f"w{conf['window']}")
    if conf.get("sparse_keys"):
        parts.append(f"s{conf['sparse_keys']}")
    for key in ("feature_map", "quantize"):
        if conf.get(key):
            parts.append(str(conf[key]))
    digest = hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts)) + f"-{digest}"


class ResultStore:
    """One JSON file per configuration: {"configuration": {...}, "tasks": {name: {"settings", "result",
    "earlier"}}}: a task's latest result, and in "earlier" (absent when none) its results with other
    settings, so a grid of settings run as separate commands keeps every cell."""

    def __init__(self, directory: str | os.PathLike, conf: dict):
        """`directory`: as check_results_dir returned it (the CLI checks it before the model loads)."""
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidArgumentError(f"--results {directory}: cannot create it ({e.strerror})") from None
        self.conf = conf
        self.path = self.directory / f"{slug(conf)}.json"
        self.data = {"configuration": conf, "tasks": {}}
        if self.path.exists() and not self.path.is_file():
            raise InvalidArgumentError(f"{self.path}: not a file (this configuration's results go there); move it away")
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidArgumentError(f"{self.path}: not a results file ({e}); move it away to start over") \
                    from None
            why = stored_problem(data, conf)
            if why:   # never rewritten: what it holds would be lost
                raise InvalidArgumentError(f"{self.path}: not a results file of this configuration ({why}); "
                                           f"move it away to start over")
            self.data = data

    def get(self, task: str, settings: dict) -> dict | None:
        entry = self.data["tasks"].get(task)
        for kept in [entry, *entry.get("earlier", [])] if entry else []:
            if kept["settings"] == settings:
                return kept["result"]
        return None

    def put(self, task: str, settings: dict, result: dict) -> None:
        """Kept at once: written whole to a temporary file, then renamed over the results file (a failed
        write leaves the file as it was and is one line). Writers take turns on a lock of the directory
        (no lock file beside the results) and each merges its task into what the file holds then: two
        runs of one configuration into one directory (`--task piqa` and `--task arc_easy` at once) keep
        both results (the last writer's copy won)."""
        try:
            with _turn(self.directory):
                self._merge_from_disk()
                old = self.data["tasks"].get(task)
                earlier = [e for e in ([{"settings": old["settings"], "result": old["result"]},
                                        *old.get("earlier", [])] if old else []) if e["settings"] != settings]
                self.data["tasks"][task] = {"settings": settings, "result": result,
                                            **({"earlier": earlier} if earlier else {})}
                with replacing(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                    f.write(json.dumps(self.data, indent=1) + "\n")
        except OSError as e:
            raise InvalidArgumentError(f"cannot keep the result of {task} in {self.path}: {e.strerror}") from None

    def _merge_from_disk(self) -> None:
        """Take the tasks another writer kept since this store read the file (its entries win for their
        tasks; this store's own come after, in put)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if stored_problem(data, self.conf) is None:
            self.data["tasks"].update(data["tasks"])


@contextlib.contextmanager
def _turn(directory: Path):
    """An exclusive flock on the directory itself while the block runs (released when its descriptor
    closes); where there are no such locks (not POSIX, NFS without lockd) the block runs alone."""
    fd = None
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fd = os.open(directory, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def check_results_dir(directory: str | os.PathLike) -> Path:
    """The --results directory, tried with a file (in its nearest existing ancestor when it does not exist
    yet: it is created when the first result is kept, not by a run that fails before): one line
    (InvalidArgumentError) when it cannot hold results, before any work."""
    if not str(directory).strip():
        raise InvalidArgumentError("--results is empty; give a directory, e.g. --results results/")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise InvalidArgumentError(f"--results {directory}: not a directory; give a directory (created if missing)")
    existing = next(p for p in (directory.absolute(), *directory.absolute().parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(existing))
        probe = existing / f".gen-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        where = e.filename or directory
        raise InvalidArgumentError(f"--results {directory}: cannot keep results there ({where}: {e.strerror}); "
                                   f"give a directory you can write") from None
    return directory


def _number(x, none_ok: bool = False) -> bool:
    return (x is None and none_ok) or (isinstance(x, (int, float)) and not isinstance(x, bool))


def stored_problem(data, conf: dict) -> str | None:
    """What is wrong with a results file's contents for `conf` (None: nothing): its configuration, and
    each stored task's settings and the fields a result is read by."""
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
        return "no tasks object"
    if data.get("configuration") != conf:
        return "its configuration differs"
    for name, latest in data["tasks"].items():
        earlier = latest.get("earlier", []) if isinstance(latest, dict) else []
        if not isinstance(earlier, list):
            return f"task {name!r}: its earlier results are not a list"
        for entry in [latest, *earlier]:
            why = _entry_problem(name, entry)
            if why:
                return why
    return None


def _entry_problem(name: str, entry) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("settings"), dict) \
            or not isinstance(entry.get("result"), dict):
        return f"task {name!r} has no settings and result"
    res = entry["result"]
    if name == "passkey":
        cells = res.get("lengths")
        ok = isinstance(cells, dict) and cells and all(
            isinstance(c, dict) and isinstance(c.get("correct"), int) and isinstance(c.get("trials"), int)
            for c in cells.values()) and all(_number(res.get(k)) for k in ("prompt_tokens", "prefilled_tokens", "seconds"))
    else:
        metrics = res.get("metrics")
        ok = isinstance(metrics, dict) and all(
            isinstance(m, dict) and _number(m.get("value")) and _number(m.get("stderr"), none_ok=True)
            for m in metrics.values()) and isinstance(res.get("scoring"), dict) and _number(res.get("seconds")) \
            and all(k in res and _number(res[k], none_ok=True) for k in ("documents", "documents_available")) \
            and all(_number(v, none_ok=True) for v in res["scoring"].values())   # (the line printed reads them)
    return None if ok else f"task {name!r}: a malformed result"


def register() -> None:
    """Name the `gen` model in lm-eval's registry, to be imported when a run asks for it."""
    from lm_eval.api.registry import model_registry
    if "gen" not in model_registry:
        model_registry.register("gen", target="engine.tasks.adapter:GenLM")


def run_lm_eval_task(llm, name: str, yaml_path: str | os.PathLike, limit: int | None = None,
                     max_length: int | None = None, bootstrap_iters: int = BOOTSTRAP_ITERS,
                     length_option: str | None = None) -> dict:
    """Score one task YAML with lm-eval on `llm` (an engine.api.LLM, through engine.tasks.adapter.GenLM,
    with its weights dequantized in place); Hugging Face libraries offline. length_option: how the caller
    sets max_length, for the adapter's advice (`gen eval`: "--context N")."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets   # noqa: F401  (read the variables above before lm-eval imports it)
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    register()
    stats = ScoreStats()
    t0 = time.perf_counter()
    # lm-eval prints progress notes (stdout is the caller's), and records `git describe` of the working
    # directory (not gen's version; gen does not report it), which outside a repository prints git's
    # "fatal: not a git repository" on stderr: the hash is left out
    quiet_git = mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None) \
        if hasattr(lm_eval.evaluator, "get_git_commit_hash") else contextlib.nullcontext()   # (a later lm-eval may move it)
    with contextlib.redirect_stdout(sys.stderr), quiet_git:
        out = lm_eval.simple_evaluate(model="gen", model_args={"llm": llm, "max_length": max_length, "stats": stats,
                                                                    **({"length_option": length_option} if length_option else {})},
                                      tasks=[str(yaml_path)], task_manager=TaskManager(include_defaults=False),
                                      limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False)
    seconds = time.perf_counter() - t0
    (task_name, metrics), = out["results"].items()
    result = {"task": task_name, "metrics": {}}
    for key, value in metrics.items():
        metric, _, filt = key.partition(",")
        if not filt or metric.endswith("_stderr"):
            continue
        stderr = metrics.get(f"{metric}_stderr,{filt}")
        result["metrics"][metric] = {"value": value, "stderr": stderr if isinstance(stderr, (int, float)) else None}
    n = out.get("n-samples", {}).get(task_name, {})
    result.update(documents=n.get("effective"), documents_available=n.get("original"), seconds=round(seconds, 2),
                  lm_eval=getattr(lm_eval, "__version__", None), scoring=stats.to_dict())
    return result
