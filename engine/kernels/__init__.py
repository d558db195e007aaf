"""Fused GPU kernels for the decode step, in Triton, each with its plain-torch form behind one signature.

- `linear_decode` / `linear_decode_elu1` / `linear_decode_hedgehog`: the linear-attention decode step
  (decay, S and z update, readout) in one kernel per layer call; the last two apply the feature map
  inside it (hedgehog: the learned map and its decay, constant or gated; `why_not_hedgehog` says why not).
- `softmax_decode`: split-K flash decoding over a preallocated KV cache, graph-capturable.

The kernels run on CUDA tensors when triton imports (and on CPU under `TRITON_INTERPRET=1`, for CI);
elsewhere each entry point runs its torch form. `why_not(...)` says in one line why the torch form
runs (None: the kernel runs). The chunked prefill is not here: `linear_attention_chunked`
(engine.attention.linear) is already the blocked-matmul form (fla's chunked algorithm in torch ops).
"""
from engine.kernels.backend import available, interpreting, why_not
from engine.kernels.linear import (EPS, HedgehogLayer, linear_attention_step, linear_decode,
                                   linear_decode_elu1, linear_decode_hedgehog, why_not_hedgehog)
from engine.kernels.softmax import softmax_decode, softmax_decode_torch

__all__ = ["EPS", "available", "interpreting", "why_not", "linear_attention_step", "linear_decode",
           "linear_decode_elu1", "linear_decode_hedgehog", "why_not_hedgehog", "HedgehogLayer",
           "softmax_decode", "softmax_decode_torch"]
