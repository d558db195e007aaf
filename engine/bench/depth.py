"""Reach a deep context without prefilling all of it: `--prefill-tokens P`.

A decode step's time depends on how many keys it reads (the depth), not on their values. So a
state can be brought from a real prefill of P tokens to depth N > P by repeating the P cached
keys/values (real activations, not random numbers: no odd magnitudes or denormals) into slots
P..N-1 of the KV cache and setting the position counters to N, so rotary, masks and the attention
read exactly what a state that prefilled N tokens would hold in size. Linear states (S, z) and
sliding windows (and a sparse cache's recent and cached keys) do not grow with the context: only their
counters move. The text that such a
state "holds" is meaningless: this is for timing and memory, never for outputs.
"""
from __future__ import annotations

from engine.attention.hybrid import HybridState
from engine.attention.linear import LinearState
from engine.attention.softmax import KVState
from engine.attention.sparse import SparseWindowState
from engine.attention.window import WindowState
from engine.errors import InvalidArgumentError


def extend_to_depth(state, depth: int) -> None:
    """Advance a freshly prefilled, unpadded `state` from its `slots` to `depth` slots, in place."""
    held = state.slots
    if depth < held:
        raise InvalidArgumentError(f"cannot extend a state holding {held} slots back to {depth}")
    if state.padded or held < 1:
        raise InvalidArgumentError("extend_to_depth needs an unpadded state holding at least one token")
    if isinstance(state, HybridState):
        for part in state.parts:
            extend_to_depth(part, depth)
    elif isinstance(state, KVState):
        if depth > state.max_len:
            raise InvalidArgumentError(f"depth {depth} exceeds the KV cache's capacity {state.max_len}")
        for cache in (state.k, state.v):                      # (L, B, Hkv, S_max, D)
            start = held
            while start < depth:
                n = min(held, depth - start)
                cache[:, :, :, start:start + n].copy_(cache[:, :, :, :n])
                start += n
    elif not isinstance(state, (LinearState, WindowState, SparseWindowState)):
        raise InvalidArgumentError(f"extend_to_depth does not know the {type(state).__name__} state")
    state.slots = depth
    state.lengths.fill_(depth)
