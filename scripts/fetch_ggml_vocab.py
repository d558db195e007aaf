#!/usr/bin/env python3
"""llama.cpp's vocab-only GGUF files and their expected tokenizations, for tests/test_ggml_vocab.py.

    python scripts/fetch_ggml_vocab.py                      # into .cache/ggml-vocab (or $GEN_GGML_VOCAB_DIR)
    python scripts/fetch_ggml_vocab.py --sdist FILE.tar.gz  # from a source package already on disk

llama.cpp keeps them in its models/ folder (ggml-vocab-NAME.gguf, .gguf.inp: texts separated by
`__ggml_vocab_test__` lines, .gguf.out: each text's ids, what llama.cpp's tests/test-tokenizer-0
checks). They are third-party data, never committed here: this takes them from the llama-cpp-python
source package on PyPI (pinned below: ~77 MB to download, ~61 MB kept, the vocab files that come
with expected tokenizations only). Run once per machine (.ci/run does); it does nothing when the
folder already holds this version.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
PACKAGE = f"llama-cpp-python=={VERSION}"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path(os.environ.get("GEN_GGML_VOCAB_DIR", ROOT / ".cache" / "ggml-vocab"))
STAMP = "VERSION"


def vocab_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """models/ggml-vocab-*.gguf that have .inp and .out beside them, and those two files."""
    files = {m.name: m for m in tar.getmembers() if m.isfile() and "/vendor/llama.cpp/models/ggml-vocab-" in m.name}
    keep = [name for name in files if name.endswith(".gguf") and f"{name}.inp" in files and f"{name}.out" in files]
    return [files[n + ext] for n in sorted(keep) for ext in ("", ".inp", ".out")]


def extract(sdist: Path, dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = vocab_members(tar)
        if not members:
            sys.exit(f"{sdist}: holds no vendor/llama.cpp/models/ggml-vocab-*.gguf with .inp/.out files")
        for m in members:
            with tar.extractfile(m) as src:
                (dest / Path(m.name).name).write_bytes(src.read())
    (dest / STAMP).write_text(VERSION + "\n")
    return len(members) // 3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DIR, help=f"where the files go (default {DEFAULT_DIR})")
    ap.add_argument("--sdist", type=Path, help="a llama-cpp-python .tar.gz already on disk (no download)")
    args = ap.parse_args(argv)
    stamp = args.dest / STAMP
    if args.sdist is None and stamp.is_file() and stamp.read_text().strip() == VERSION:
        print(f"{args.dest}: llama.cpp vocab files of {PACKAGE} already there")
        return
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            PACKAGE, "-d", tmp], check=True)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        n = extract(sdist, args.dest)
    print(f"{args.dest}: {n} llama.cpp vocab files with expected tokenizations (from {sdist.name})")


if __name__ == "__main__":
    main()
