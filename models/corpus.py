"""Corpus files: documents separated by a line `<|endoftext|>`.

Each document becomes BOS + text + EOS when tokenized; the marker itself never reaches
the model.
"""
from __future__ import annotations

import codecs
import hashlib
import os
from typing import Iterator

from models.errors import InvalidArgumentError

DOC_SEPARATOR = "<|endoftext|>"


def not_utf8(path: str | os.PathLike, e: UnicodeDecodeError) -> InvalidArgumentError:
    """The one-line error for a file that is not UTF-8, naming the first bad byte's offset in the file (the
    decoder's own offset counts from the start of its read buffer)."""
    decoder, done = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 16)
            held = len(decoder.getstate()[0])   # bytes of a character begun in the block before
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as bad:   # (its offsets count from the held bytes)
                return InvalidArgumentError(f"{os.fspath(path)}: not UTF-8 text ({bad.reason} at byte "
                                            f"{done - held + bad.start})")
            if not block:
                break
            done += len(block)
    return InvalidArgumentError(f"{os.fspath(path)}: not UTF-8 text ({e.reason})")


def iter_documents(path: str | os.PathLike) -> Iterator[str]:
    """Yield the documents of `path`, stripped of surrounding blank lines; empty ones skipped."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidArgumentError(f"{path}: no such file; pass a text file of documents "
                                   f"separated by lines '{DOC_SEPARATOR}'")
    lines: list[str] = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for line in f:
                if line.strip() == DOC_SEPARATOR:
                    doc = "".join(lines).strip()
                    if doc:
                        yield doc
                    lines = []
                else:
                    lines.append(line)
        except UnicodeDecodeError as e:
            raise not_utf8(path, e) from None
    doc = "".join(lines).strip()
    if doc:
        yield doc


def read_documents(path: str | os.PathLike) -> list[str]:
    docs = list(iter_documents(path))
    if not docs:
        raise InvalidArgumentError(f"{os.fspath(path)}: holds no documents")
    return docs


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a (training) file's bytes, read a MiB at a time: what a resumed run checks its text by."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
