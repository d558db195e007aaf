"""What every command shares: turning engine errors into one line on stderr and exit code 2."""
from __future__ import annotations

import sys

import click

from engine.errors import EngineError


def fail(message: str, code: int = 2) -> None:
    click.echo(f"gen: error: {message}", err=True)
    sys.exit(code)


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
