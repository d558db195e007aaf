"""What every command shares: turning engine errors into one line on stderr and exit code 2."""
from __future__ import annotations

import os
import sys

import click

from engine.errors import EngineError


def fail(message: str, code: int = 2) -> None:
    click.echo(f"gen: error: {message}", err=True)
    sys.exit(code)


def check_output_path(path: str) -> None:
    """An output file's directory must exist and be writable; else one line, exit 2, before any work."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        fail(f"{path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        fail(f"{path}: directory {parent} is not writable")
    if os.path.isdir(path):
        fail(f"{path}: is a directory; give a file name")


def run_guarded(fn):
    """Run fn(); an EngineError (or bad file) becomes one line on stderr and exit code 2."""
    try:
        return fn()
    except EngineError as e:
        fail(str(e))
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        fail(f"{e.filename}: {e.strerror}")
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(130)


FEATURE_MAP_HELP = ("linear attention feature map: elu1, relu, softmax, cos1, or hedgehog (the learned maps a "
                    "model such as smollm2-linear ships); zero switches the linear branch off (with --window: "
                    "sliding-window attention alone, an ablation)")

KV_DTYPE_HELP = ("the KV cache's dtype (default: the model's): float32, float16, bfloat16; float16 under fp32 "
                 "weights halves the cache, as llama.cpp keeps it")
