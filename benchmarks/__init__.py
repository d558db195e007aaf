"""Benchmark scripts, run from the repository root as `python benchmarks/NAME.py` (benchmarks/README.md).

They reach the engine through its public face (`engine.load`, the RunSpec, `gen`) and import each other
as siblings (`from common import ...`: Python puts a script's own folder first on sys.path). This file
makes the folder a package so that the layer contract (pyproject.toml [tool.importlinter]) covers it:
benchmarks sit on top of cli, engine and models, and nothing below imports them.
"""
