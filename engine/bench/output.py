"""Writing a file the user named (`gen bench --json`, `--plot`): whole or not at all where it is a file,
in place where it is something else.

    write_output("bench.json", lambda f: f.write(text))    # a temporary file beside it, then renamed
    write_output("/dev/null", lambda f: f.write(text))     # opened and written, as a shell's `>` does
    write_output("/dev/stdout", lambda f: f.write(text))   # through stdout's own descriptor
"""
from __future__ import annotations

import os
import stat
import sys
from typing import IO, Callable

from engine.errors import InvalidArgumentError
from models.replace import replacing


def _stdio(path: str | os.PathLike):
    """sys.stdout or sys.stderr when `path` is the very file it writes to (/dev/stdout, /dev/fd/1, or its
    name: `--json out.txt > out.txt`), else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            if os.path.samestat(st, os.fstat(stream.fileno())):
                return stream
        except (AttributeError, OSError, ValueError):   # closed, or no descriptor (a test runner's buffer)
            continue
    return None


def written_in_place(path: str | os.PathLike) -> bool:
    """Whether `path` (its links followed) exists and is not a regular file (a device such as /dev/null,
    a FIFO), or is this process's stdout or stderr. Such a path is written where it is: renaming a file
    over it would replace the device or pipe with a regular file, or leave what stdout prints after it
    in a file no name reaches."""
    if _stdio(path) is not None:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path)
    except OSError:
        return False


def write_output(path: str | os.PathLike, write: Callable[[IO], object], binary: bool = False) -> str:
    """Write `path` with write(f), f an open text (utf-8) or binary file; returns the path as given.

    A regular file, or a new one, is written whole to a temporary file in its directory and then renamed
    over it: a failed write leaves it as it was and no temporary behind. A symbolic link is followed: its
    target is replaced (keeping its permission bits) and the link stays a link. A device or FIFO
    (`written_in_place`) is opened and written; stdout's or stderr's own file through its descriptor.
    Any OSError (a missing directory, /dev/full's ENOSPC, a reader that left) is InvalidArgumentError,
    one line naming the path.
    """
    mode, encoding = ("wb", None) if binary else ("w", "utf-8")
    try:
        stream = _stdio(path)
        if stream is not None:   # through its own descriptor (shared offset): between what it printed and prints
            stream.flush()
            with open(os.dup(stream.fileno()), mode, encoding=encoding) as f:
                write(f)
            return os.fspath(path)
        if written_in_place(path):
            with open(path, mode, encoding=encoding) as f:
                write(f)
            return os.fspath(path)
        with replacing(path) as tmp, open(tmp, mode, encoding=encoding) as f:   # a link followed, its bits kept
            write(f)
    except OSError as e:
        raise InvalidArgumentError(f"cannot write {os.fspath(path)}: {e.strerror or e}") from None
    return os.fspath(path)
