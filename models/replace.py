"""Replacing a file whole: written to a temporary file beside it, then renamed over it.

    with replacing("model.safetensors") as tmp:
        save_file(tensors, tmp)            # a failure here leaves the old file as it was, no temporary behind

A symbolic link is followed (its target is replaced, the link stays a link); the new file keeps an
existing target's permission bits, else takes the umask's (mkstemp alone makes 0600), or 0600 where
`private`. The temporary's name is unique (a user's own FILE.tmp is never touched) and short enough for
any valid FILE. Used by the checkpoint writers (models.weights) and `gen bench --json/--plot`
(engine.bench.output), which also writes devices and FIFOs in place.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike, private: bool = False) -> Iterator[str]:
    """Yield a temporary path in `path`'s (its link target's) directory; on a clean exit it becomes the
    file. OSError (a missing directory, a loop of links, no permission) propagates for the caller to name."""
    real = os.path.realpath(path)   # a link's target (existing or not): renaming onto the link would replace it
    try:
        bits = stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        bits = 0o666 & ~umask   # as open() would have made it
    if private:
        bits = 0o600
    name = os.path.basename(real)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(real), prefix=f".{name[:100]}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, bits)
        os.replace(tmp, real)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)   # gone after the rename; left by a failure


__all__ = ["replacing"]
