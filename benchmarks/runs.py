"""Loading for the benchmark scripts through the public API: `engine.load` and the run it resolves
(`LLM.spec`, an engine.runspec.RunSpec).

    llm, stored = load_weights("smollm2", "q8_0", threads=1)   # gen bench --weights' names, plus gguf
    two = with_run(llm, threads=2)                            # the same weights, another run

`with_run` is the same model and tokenizer under a changed RunSpec, with a fresh step (its pool and
weight copies built for that run): what a script that compares thread counts, activations or chunk
sizes on one loaded model needs, without loading the weights twice.
"""
from __future__ import annotations

import dataclasses

import engine
from engine.bench.sweep import WEIGHTS          # gen bench --weights: name -> (dtype, quantization at load)
from engine.quant import QuantLinear, dequantize_model

FLOATS = ("f32", "f16", "bf16")


def load_weights(model: str, weights: str, dequantize: bool = True, **options):
    """engine.load with the weights named as `gen bench --weights` names them, or `gguf` (as the file
    stores them): q8_0/q4_0/q4_1 requantize the matrices at load, f32/f16/bf16 load in that dtype and,
    with `dequantize`, decode a GGUF's blocks to float matrices (engine.quant.dequantize_model: the API
    keeps a GGUF's blocks). Returns (LLM, what the matrices are stored as: "q4_1+q8_0", "float16")."""
    dtype, quantize = WEIGHTS.get(weights, ("float32", None))
    llm = engine.load(model, dtype=dtype, quantize=quantize, **options)
    if dequantize and weights in FLOATS:
        dequantize_model(llm.model)
        llm = with_run(llm)      # a step built on the float matrices
    return llm, stored_as(llm.model)


def stored_as(model) -> str:
    kinds = sorted({m.kind for m in model.modules() if isinstance(m, QuantLinear)})
    return "+".join(kinds) if kinds else str(model.dtype).removeprefix("torch.")


def with_run(llm: engine.LLM, **changes) -> engine.LLM:
    """`llm`'s model and tokenizer under its RunSpec with `changes` (threads, backend, activations,
    prefill_chunk, ...), with a fresh step."""
    out = engine.LLM(llm.model, llm.tokenizer, name=llm.name, chat_template=llm.chat_template,
                     sampling=llm.sampling, spec=dataclasses.replace(llm.spec, **changes))
    out.map_sets = llm.map_sets
    return out
