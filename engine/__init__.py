"""The engine: attention paths, the transformer, step forms, sampling, stop rules, the generation
loop and the Python API.

    from engine import load
    llm = load("tiny", attention="linear")
"""
import os as _os
import sys as _sys

# PyTorch's OpenMP threads (libgomp) spin ~300,000 iterations after every parallel kernel. With
# --threads N > 1 the sampler's kernels over (B, vocab) logits go parallel every decode step, and
# the spinning threads hold the cores the native step's pool needs next: tiny, batch 16, 2 threads,
# 7.5-8.0 -> 4.4 ms a step with 10,000 (Zen 3 VM, 2026-11-25); a prompt block's forward is no slower.
# libgomp reads it once, when torch is first imported; a setting of the user's own wins.
if "torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from engine.api import LLM, TextStream, UntrainedPathWarning, load, make_config
from engine.generate import Generation, GenerationConfig, Result, Stats, TokenEvent
from engine.sampling import Sampler, SamplingParams

__all__ = sorted(["load", "LLM", "TextStream", "UntrainedPathWarning", "Generation", "GenerationConfig", "Result",
                  "Stats", "TokenEvent", "make_config", "Sampler", "SamplingParams"])
