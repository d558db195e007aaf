"""What the benchmark scripts share: string options with defaults, the load average, JSON written whole.

The scripts run as `python benchmarks/NAME.py`, so this module is imported as `common`.
"""
from __future__ import annotations

import argparse
import json
import os


def options(doc: str, **defaults: str) -> argparse.ArgumentParser:
    """A parser described by the first line of `doc`, with `--name` (underscores as dashes) for each
    default; callers add their other options to it."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), default=default, help=f"default: {default}")
    return ap


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_json(path: str, obj) -> None:
    """Write `obj` to `path` whole or not at all (a .tmp file, then renamed)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)
