"""The native step form (C via ctypes): one-token steps of a batch in C, either attention path.

    make_step(model, backend="native")      # or load(..., backend="native"), gen --backend native

It runs the one-token step of a CPU state (a KV cache; a linear state with any of the four fixed
feature maps or learned hedgehog maps; a sliding window + linear state; a hybrid of a KV cache and
one of those, per layer) of a Llama-shaped model (Llama, Mistral, Qwen2's q/k/v biases, Qwen3's
per-head q/k norms), any batch size, left-padded rows included, on weights in fp32, f16, bf16 or
quantized blocks (engine.quant: q8_0, q4_0, q4_1, a GGUF file's q5_0, q5_1, q4_k, q5_k, q6_k, and stacks of
them), on `threads` threads (RunSpec.threads). The C code reads the model's weight tensors and
writes the state's own tensors in place through their data pointers, so a prefill on either side
and decode share one state (`prefill` runs prompt blocks on the pool too). Compute is fp32 (16-bit
weights widened), except quantized matrices: there each matmul rounds its activations to q8 blocks
and takes one int8 dot per block, as llama.cpp does (qdot.c; engine.quant.linear_q8 is the PyTorch
twin the tests hold it to).

Python files, one job each:
  build.py    compile the C sources once (cached on disk) and load them
  abi.py      gen.h's Mat, Plan and type codes mirrored in ctypes, checked against the library's
              own layout (decode.c gen_abi) when it binds: `bind()`, `NativeABIError`
  pool.py     the thread pool's knobs and counters (pool_rest, pool_stats, set_parallel_min, ...)
  weights.py  which tensor the C step reads per weight, and the copies derived once
              (`DerivedWeights`: 16-bit copies of exactly-16-bit fp32 weights, regrouped blocks),
              owned by the step that made them, never hung on the model
  cases.py    `why_not`: the cases the C step covers, and the reason for every other
  plan.py     `NativeDecoder`: the Plan of one (model, state), re-checked before every step
  step.py     `NativeStep`: the step form (a plan per state; its options, its weight copies)

EXACT16 and REGROUP are the defaults of NativeStep's `exact16` / `regroup` options, kept as
module-level switches for the tests that set them.
"""
from __future__ import annotations

from engine.runspec import ACTIVATIONS, check_activations  # noqa: F401 (re-exported)
from engine.steps.native.abi import (FLOAT_TYPES, HEDGEHOG_MAX_D, MODES, T_Q4_1R, T_Q5R, T_Q8_0R, TYPES,  # noqa: F401
                                     Mat, NativeABIError, Plan, bind)
from engine.steps.native.build import NativeUnavailableError, library
from engine.steps.native.cases import why_not
from engine.steps.native.plan import PREFILL_ROWS, NativeDecoder
from engine.steps.native.pool import (PARALLEL_MIN_MACS, POOL_ADAPT, pool_adapt, pool_rest,  # noqa: F401
                                      pool_spin, pool_stats, pool_workers, set_parallel_min)
from engine.steps.native.step import NativeStep
from engine.steps.native.weights import DerivedWeights, regroup, weights_read

EXACT16 = True   # NativeStep(exact16=None) reads this: fp32 weights of 16-bit values run from 16-bit copies
REGROUP = True   # NativeStep(regroup=None) reads this: q4_1 / q8_0 blocks run regrouped where the build can


def _regrouped(_owner, blocks, rows: int, q4_1: bool):
    """`regroup(blocks, rows, q4_1)` under its former name (tests/test_quant.py); nothing is cached."""
    return regroup(blocks, rows, q4_1)


__all__ = ["NativeStep", "NativeDecoder", "NativeUnavailableError", "NativeABIError", "DerivedWeights", "library",
           "bind", "pool_adapt", "pool_rest", "pool_spin", "pool_workers", "pool_stats", "set_parallel_min",
           "PARALLEL_MIN_MACS", "weights_read", "why_not", "Mat", "Plan", "TYPES", "PREFILL_ROWS"]
