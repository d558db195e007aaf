"""The repository stays readable (issue 31): benchmark and helper scripts import the project as
installed (no sys.path edits), sit under the layer contract, weights/ ships no logs, and every run
file kept under docs/ is one a markdown page points to."""
from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\s*\(|\+=|=[^=]|\[[^\]]*\]\s*=[^=])"
                           r"|site\.addsitedir\s*\(")
MAX_WEIGHTS_TEXT_LINES = 200
RUN_FILES = ("*.json", "*.png")
MAX_GLOB = 4
# a path or glob to a run file (docs/serve_bench_tiny_20261126_{rest,norest}_{1,2}.json, web.png) or a folder under docs/
REFERENCE = re.compile(r"[\w./{},*-]*\.(?:json|png)\b|docs/[\w/-]+/")


def sys_path_edits(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if SYS_PATH_EDIT.search(line)]


def test_no_script_edits_sys_path():
    """Scripts run from the checkout import engine/models/cli as installed (pip install -e) and their
    siblings by Python's own script-folder rule; an A/B of two checkouts sets PYTHONPATH per process."""
    found = [f"{p.relative_to(ROOT)}: {line}" for folder in ("benchmarks", "scripts")
             for p in sorted((ROOT / folder).rglob("*.py")) for line in sys_path_edits(p.read_text())]
    assert not found, "edit no sys.path (use the installed package, PYTHONPATH or importlib):\n" + "\n".join(found)


def test_the_sys_path_check_sees_each_form():
    for edit in ("sys.path.insert(0, x)", "sys.path.append(d)", "sys.path += [d]", "sys.path = [d]",
                 "sys.path[:0] = [d]", "site.addsitedir(d)", 'RUN = """sys.path.insert(0, sys.argv[1])"""'):
        assert sys_path_edits(edit), edit
    for fine in ("print(sys.path)", "if d in sys.path:", "sys.path == x", "a script's folder first on sys.path"):
        assert not sys_path_edits(fine), fine


def test_benchmarks_are_under_the_layer_contract():
    text = (ROOT / "pyproject.toml").read_text()
    roots = re.search(r"^root_packages\s*=\s*\[([^\]]*)\]", text, re.M)
    layers = re.search(r'^layers\s*=\s*\["benchmarks", "cli", "engine", "models"\]', text, re.M)
    assert roots and '"benchmarks"' in roots.group(1) and layers, \
        "pyproject.toml [tool.importlinter]: benchmarks on top of cli -> engine -> models"
    assert (ROOT / "benchmarks" / "__init__.py").is_file(), "import-linter sees benchmarks/ as a package"


def text_lines(path: Path) -> int | None:
    """Lines of a text file (UTF-8, no NUL byte); None for a binary one."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8").count("\n")
    except UnicodeDecodeError:
        return None


def test_weights_ship_no_logs():
    """Model directories hold weights, configs and short cards; training logs live in docs/training/."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "weights").rglob("*"))
            if p.is_file() and (n := text_lines(p)) is not None and n > MAX_WEIGHTS_TEXT_LINES]
    assert not long, f"text files under weights/ over {MAX_WEIGHTS_TEXT_LINES} lines (logs?):\n" + "\n".join(long)


def expand_braces(pattern: str) -> list[str]:
    """a_{x,y}_{1,2} -> a_x_1, a_x_2, a_y_1, a_y_2 (as the shell writes a set of files)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [out for alt in m.group(1).split(",")
            for out in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def references() -> list[tuple[Path, str]]:
    """(the folder of a markdown file, a path/glob it names) for every .md of the repository."""
    out = []
    for md in sorted(ROOT.rglob("*.md")):
        if any(part.startswith(".") for part in md.relative_to(ROOT).parts):
            continue
        for ref in REFERENCE.findall(md.read_text(encoding="utf-8")):
            out += [(md.parent, p) for p in expand_braces(ref)]
    return out


def names(folder: Path, ref: str, path: Path) -> bool:
    """`ref` names `path` as written (from the repository root) or from its page's folder; a folder
    ref (docs/gpu/) names what is in it."""
    rel = path.relative_to(ROOT).as_posix()
    for form in {ref.rstrip("/"), os.path.relpath(os.path.join(folder, ref), ROOT).replace(os.sep, "/")}:
        if rel.startswith(form + "/") if ref.endswith("/") else fnmatch.fnmatchcase(rel, form):
            return True
    return False


def cited(files: list[Path], refs) -> set[Path]:
    """The files some ref names. A glob cites the files of one run (at most MAX_GLOB of them:
    serve_bench_tiny_20261126_*.json), not a whole kind (`*.json` in an index, `docs/serve_bench_*.json`
    in a command line)."""
    out: set[Path] = set()
    for folder, ref in refs:
        hits = [f for f in files if names(folder, ref, f)]
        if "*" not in ref or len(hits) <= MAX_GLOB:
            out.update(hits)
    return out


def run_files() -> list[Path]:
    return sorted(p for pattern in RUN_FILES for p in (ROOT / "docs").rglob(pattern))


def test_every_run_file_under_docs_is_named_by_a_page():
    """docs/ keeps the JSON and PNG files a page shows or cites (older runs live in git history)."""
    files = run_files()
    found = cited(files, references())
    orphans = [p.relative_to(ROOT).as_posix() for p in files if p not in found]
    assert not orphans, "no .md names these run files; cite them or git rm them:\n" + "\n".join(orphans)


def test_the_reference_check_reads_paths_globs_braces_and_folders():
    docs = ROOT / "docs"
    files = [docs / n for n in ("web.png", "webb.png", "a_1_x.json", "a_1_y.json", "gpu/h.json", "gpux/h.json",
                                "s_norest_2.json", "s_other_1.json", *[f"k_{i}.json" for i in range(MAX_GLOB + 1)])]
    refs = [(docs, "web.png"), (ROOT, "docs/a_*_x.json"), (ROOT, "docs/gpu/"), (docs, "k_*.json"), (docs, "*.json"),
            *[(ROOT, p) for p in expand_braces("docs/s_{rest,norest}_{1,2}.json")]]
    got = {p.relative_to(docs).as_posix() for p in cited(files, refs)}
    assert got == {"web.png", "a_1_x.json", "gpu/h.json", "s_norest_2.json"}
