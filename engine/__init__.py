"""The engine: attention paths, the transformer, step forms, sampling, stop rules, the generation
loop and the Python API.

    from engine import load
    llm = load("tiny", attention="linear")
"""
from engine.api import LLM, TextStream, UntrainedPathWarning, load, make_config
from engine.generate import Generation, GenerationConfig, Result, Stats, TokenEvent
from engine.sampling import Sampler, SamplingParams

__all__ = sorted(["load", "LLM", "TextStream", "UntrainedPathWarning", "Generation", "GenerationConfig", "Result",
                  "Stats", "TokenEvent", "make_config", "Sampler", "SamplingParams"])
