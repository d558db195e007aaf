"""The engine: attention paths, sampling, stop rules, the generation loop and the Python API.

    from engine import load
    llm = load("tiny", attention="linear")

Public names are imported lazily, so `import engine.attention` (which the model code does)
does not pull in the loader and its model imports.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "load": "engine.api", "LLM": "engine.api", "TextStream": "engine.api", "UntrainedPathWarning": "engine.api",
    "Generation": "engine.generate", "GenerationConfig": "engine.generate", "Result": "engine.generate",
    "Stats": "engine.generate", "TokenEvent": "engine.generate",
    "make_config": "engine.api", "Sampler": "engine.sampling", "SamplingParams": "engine.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
