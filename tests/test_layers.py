"""The package layers point one way (cli -> engine -> models), checked two ways."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OWN = ("cli", "engine", "models")


def test_import_linter_contracts_are_kept():
    # the venv's own script when the venv is not activated (python -m pytest from .venv/bin/python)
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    print(r.stdout[-3000:])
    assert r.returncode == 0, "an import points up a layer; see the contract output above"


def deferred_own_imports(path: Path) -> list[str]:
    """Imports of the project's own packages inside a function body (a deferral that hides a cycle)."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in OWN]
    return found


def test_no_own_import_is_deferred_into_a_function():
    found = [hit for pkg in OWN for path in sorted((ROOT / pkg).rglob("*.py")) for hit in deferred_own_imports(path)]
    assert not found, "move these imports to the top of their module:\n" + "\n".join(found)
