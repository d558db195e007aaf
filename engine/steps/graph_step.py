"""The graph step form: the torch step's one-token decode captured as a CUDA graph and replayed,
gpt-fast's way (static buffers, one capture per shape), with `torch.cuda.CUDAGraph`.

A decode step is hundreds of small kernels; on a GPU at batch 1 their launches, not the bytes, set
the time. A captured graph launches them all at once. A graph replays the same kernels on the same
addresses with the same arguments, so nothing that moves from token to token may be a Python value
inside it. `decode_static` is `torch_step.decode_one`'s arithmetic (the same `DecodePlan`) with
every such value read from device tensors:

- the rotary row of each sequence: gathered at `state.lengths` (padded batches or not);
- the KV slot written: `index_copy_` at a 1-element slot tensor, not `narrow(start)`;
- softmax attention: over a fixed-length prefix of the cache, the *bucket* (`decode_bucket`: the
  next power of two >= slots + 1, at least `BUCKET_MIN`, at most max_len), masked past the slot
  tensor and at pad slots (`engine.steps.decode_attention.softmax_decode`);
- linear and window layers run their states' own one-token `attend`, already static (in-place
  tensor ops only, no position read: the span they get carries no start).

What is Python stays outside the graph: `state.open` (shape and capacity checks) before the replay
and `state.commit` (slots, lengths, the window's wreal shift) after, so the state ends as
decode_one leaves it. `GraphStep` captures once per (batch size, bucket, rotary rows, the state's
tensors' addresses and layout, the plan) and keeps the last `GRAPHS_KEPT` graphs (a server swaps
states on every join or leave: a new state is a new capture), all in one memory pool.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.attention import HybridState, KVState, LinearState, WindowState
from engine.attention.sliding import sliding_part
from engine.attention.base import Span
from engine.attention.sparse import SparseWindowState
from engine.steps.decode_attention import softmax_decode
from engine.steps.torch_step import DecodePlan, TorchStep, decode_one, layer_stack

BUCKET_MIN = 256    # the shortest cache prefix softmax decode attends over (a graph per power of two above)
GRAPHS_KEPT = 8     # captured graphs kept (least recently replayed dropped first)
WARMUP = 3          # eager runs on the capture stream before capturing (PyTorch's CUDA graph recipe)
STATES = (KVState, LinearState, WindowState, HybridState)

# The span linear and window layers get: one token, no pads, and no position (a read of `start`
# inside the static step would bake a Python int into the graph: it fails here instead).
ONE_TOKEN = Span(start=None, length=1, positions=None, real=None)


def decode_bucket(slots: int, max_len: int, min_bucket: int = BUCKET_MIN) -> int:
    """The cache prefix a one-token step at slot `slots` attends over: the next power of two >= slots + 1,
    at least `min_bucket`, at most `max_len`."""
    return min(max_len, max(min_bucket, 1 << slots.bit_length()))


def kv_part(state) -> KVState | None:
    """The state's KV cache: the state itself, a hybrid's softmax part, or None (no softmax layer)."""
    if isinstance(state, KVState):
        return state
    if isinstance(state, HybridState) and isinstance(state.parts[0], KVState):
        return state.parts[0]
    return None


def static_shape(state, slots: int, min_bucket: int = BUCKET_MIN) -> tuple[int | None, int]:
    """(bucket, rotary rows) of a step at slot `slots`: the softmax bucket (None without a KV cache),
    and the rotary table's rows the step may read (every position <= slots; doubles with the bucket)."""
    kv = kv_part(state)
    return (None if kv is None else decode_bucket(slots, kv.max_len, min_bucket),
            decode_bucket(slots, 1 << 62, min_bucket))


def layer_route(state, layers: int) -> list[tuple]:
    """Per model layer: (the state that serves it, its layer index there)."""
    if isinstance(state, HybridState):
        return [(state.parts[p], j) for p, j in state.where]
    return [(state, i) for i in range(layers)]


def kv_attend_static(kv: KVState, layer: int, q, k, v, slot, n_keys, bucket: int):
    """Write k, v (B, Hkv, 1, D) at `slot` of layer `layer`'s cache, attend over its first `bucket` slots."""
    kv.zero_unwritten()                # the bucket is read under a mask (on the CPU only: a flag test)
    cache_k, cache_v = kv._layers[layer]                                  # (B, Hkv, S_max, D)
    cache_k.index_copy_(2, slot, k if k.dtype == cache_k.dtype else k.to(cache_k.dtype))
    cache_v.index_copy_(2, slot, v if v.dtype == cache_v.dtype else v.to(cache_v.dtype))
    key_real = kv.slot_real.narrow(1, 0, bucket) if kv.padded else None
    return softmax_decode(q, cache_k.narrow(2, 0, bucket), cache_v.narrow(2, 0, bucket), n_keys, key_real, kv._scale)


def decode_static(plan: DecodePlan, tokens: torch.Tensor, state, slot: torch.Tensor, bucket: int | None,
                  rope_rows: int) -> torch.Tensor:
    """tokens (B, 1) int64 -> logits (B, 1, V): decode_one's arithmetic, no Python position.

    slot: (1,) int64 on the device, the slot this token is written at (= state.slots); bucket: the
    softmax prefix length (`static_shape`); rope_rows: rotary rows to have (> every position read).
    Writes the KV slot and updates linear and window states in place; does not open or commit
    `state` (the caller does, around it). No host syncs, no Python branch on a tensor's values.
    """
    B = tokens.shape[0]
    rotary = None
    if state.path in plan.rope_paths:
        cos, sin = plan.rotary.signed_table(rope_rows, tokens.device, plan.embed.dtype)   # (n, D)
        at = state.lengths                                                          # sequence b at position lengths[b]
        rotary = cos.index_select(0, at).view(B, 1, 1, plan.D), sin.index_select(0, at).view(B, 1, 1, plan.D)
    n_keys = None if bucket is None else (slot + 1).repeat(B)                       # (B,) contiguous
    route = layer_route(state, len(plan.base))

    def attend(i, q, k, v):
        part, j = route[i]
        if part.path == "softmax":
            return kv_attend_static(part, j, q, k, v, slot, n_keys, bucket)
        return part.attend(j, q, k, v, ONE_TOKEN)                      # linear / window: static already

    return layer_stack(plan, tokens, state, rotary, attend)


def step_static(plan: DecodePlan, tokens: torch.Tensor, state, min_bucket: int = BUCKET_MIN) -> torch.Tensor:
    """One eager step of the static form: open, `decode_static`, commit (what a replay does, uncaptured)."""
    span = state.open(tokens)
    slot = torch.full((1,), span.start, dtype=torch.long, device=tokens.device)
    logits = decode_static(plan, tokens, state, slot, *static_shape(state, span.start, min_bucket))
    state.commit(span)
    return logits


def parts_of(state) -> list:
    return list(state.parts) if isinstance(state, HybridState) else [state]


def graph_tensors(state) -> list[torch.Tensor]:
    """Every state tensor a captured step reads or writes (its address and layout key the graph)."""
    out = [state.lengths]
    for p in parts_of(state):
        if isinstance(p, KVState):
            out += [p.k, p.v, p.slot_real, p._scale, *p._layers[0]]
        elif isinstance(p, WindowState):
            out += [p.S, p.z, p.wk, p.wv, p.wreal]
        else:
            out += [p.S, p.z, *p._layers[0]]
    return out


def moving_tensors(state) -> list[torch.Tensor]:
    """The state tensors a step changes other than by writing its own KV slot (warm-up runs restore them)."""
    return [t for p in parts_of(state) if not isinstance(p, KVState) for t in p.tensors()]


def map_tensors(state) -> list[torch.Tensor]:
    """A learned feature map's parameters (hedgehog): read by the graph; adding a decay changes the code."""
    fm = getattr(state, "feature_map", None)
    return [t for t in fm.parameters()] if isinstance(fm, torch.nn.Module) else []


def layout(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class _Captured:
    """One captured step: the graph, its static input buffers and its static output."""

    def __init__(self, graph, tokens, slot, logits, keep):
        self.graph, self.tokens, self.slot, self.logits, self.keep = graph, tokens, slot, logits, keep


class GraphStep:
    """The graph form of the one-token step (see the module docstring). CUDA only: `why_not` says why
    not elsewhere. torch_step: the torch form whose DecodePlan it shares (the Stepper's)."""
    name = "graph"

    def __init__(self, model, torch_step: TorchStep | None = None, min_bucket: int = BUCKET_MIN,
                 keep: int = GRAPHS_KEPT, compile: bool = False):
        self.model, self.torch_step = model, torch_step or TorchStep(model)
        # compile: the static step goes through torch.compile (inductor fuses its elementwise kernels:
        # the norms, rotary, SiLU) before it is captured; the first step of each shape then takes the
        # compile's seconds to minutes (backend "compiled"); without it the eager kernels are captured.
        self.compile = compile
        self.name = "compiled" if compile else "graph"
        self._static = None
        self.min_bucket, self.keep = min_bucket, keep
        self.graphs: OrderedDict = OrderedDict()
        self.pool = self.stream = None   # one CUDA graph memory pool and one capture stream for every capture
        self.plan: DecodePlan | None = None
        self.captures = 0           # graphs captured so far (tests: a swap recaptures, a replay does not)
        self.broken: str | None = None   # why a capture failed: the form then refuses for good

    def why_not(self, state, tokens) -> str | None:
        if sliding_part(state) is not None:
            return (f"the graph step has no sliding-window KV cache (a ring of {sliding_part(state).softmax_window} "
                    f"slots, Mistral's sliding_window); the torch step runs it")
        if any(isinstance(p, SparseWindowState) for p in parts_of(state)):
            return ("the graph step has no sparse cache of hard keys (its decisions every 64 tokens run in Python); "
                    "the torch step runs it")
        if tokens.device.type != "cuda":
            return f"the graph step runs on CUDA only, not {tokens.device.type}"
        if self.broken is not None:
            return self.broken
        if not isinstance(state, STATES):
            return f"the graph step does not know the state {type(state).__name__}"
        if state.device != tokens.device:
            return f"the state is on {state.device}, the tokens on {tokens.device}"
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph capture is already under way on this stream"
        return None

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (B, 1) int64 on CUDA -> logits (B, 1, V)."""
        plan = self.torch_step.plan_for(tokens)
        if plan is not self.plan:       # new weights (or dtype, device): every graph read the old ones
            self.graphs.clear()
            # and a new pool: the old one went with its last graph (capturing into its handle again trips
            # the CUDA caching allocator's assert, `use_count > 0`, seen on an H100)
            self.pool = None
            self.plan = plan
        span = state.open(tokens)       # checks shapes and capacity before anything runs
        bucket, rope_rows = static_shape(state, span.start, self.min_bucket)
        rope = state.path in plan.rope_paths
        if rope:                        # grow the shared rotary table now, never inside a capture
            plan.rotary.signed_table(rope_rows, tokens.device, plan.dtype)
        key = self._key(plan, state, tokens, bucket, rope_rows if rope else None)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(plan, tokens, state, span.start, bucket, rope_rows)
            if entry is None:           # capture failed (self.broken says why): this step runs eagerly
                return decode_one(plan, tokens, state)
            self.graphs[key] = entry
            while len(self.graphs) > self.keep:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        entry.tokens.copy_(tokens)
        entry.slot.fill_(span.start)
        entry.graph.replay()
        state.commit(span)
        return entry.logits.clone()

    def _static_fn(self):
        """decode_static, or its torch.compile'd form (built once; dynamo recompiles per new shape)."""
        if not self.compile:
            return decode_static
        if self._static is None:
            self._static = torch.compile(decode_static, fullgraph=True, dynamic=False)
        return self._static

    def _key(self, plan, state, tokens, bucket, rope_rows) -> tuple:
        table = plan.rotary._cos if state.path in plan.rope_paths else None
        fm = getattr(state, "feature_map", None)
        return (tokens.shape, tokens.dtype, bucket, rope_rows, type(state), tuple(p.padded for p in parts_of(state)),
                tuple(getattr(state, "layer_paths", ())), tuple(getattr(state, "where", None) or ()),
                tuple(getattr(p, "layer_ids", None) for p in parts_of(state)), id(fm),
                None if table is None else (layout(table), layout(plan.rotary._sin_signed)),
                tuple(layout(t) for t in graph_tensors(state)), tuple(layout(t) for t in map_tensors(state)))

    def _capture(self, plan, tokens, state, start: int, bucket, rope_rows) -> _Captured | None:
        """Warm up on a side stream (restoring the state after each run), capture, return the entry; None
        (with `broken` set and the state as it was) if the capture fails."""
        plan.layers(state)      # an adapted model's per-path weights: built now, on this stream
        static_tokens = tokens.clone()
        slot = torch.full((1,), start, dtype=torch.long, device=tokens.device)
        saved = [t.clone() for t in moving_tensors(state)]

        def restore():
            for t, s in zip(moving_tensors(state), saved):
                t.copy_(s)

        static = self._static_fn()

        def run():
            return static(plan, static_tokens, state, slot, bucket, rope_rows)

        if self.pool is None:   # one pool and one side stream for every capture (PyTorch's recipe)
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device=tokens.device)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                for _ in range(WARMUP):
                    run()
                    restore()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # capture_begin/end rather than `with torch.cuda.graph(...)`: its exit leaves the side stream
                # current when ending the capture raises
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    logits = run()
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:  # noqa: BLE001, S110 - the capture's own error is the one to report
                        pass
                    raise
                graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: refuse from now on, say why, run eagerly
            torch.cuda.current_stream().wait_stream(stream)
            restore()
            self.broken = "graph capture failed: " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
            return None
        self.captures += 1
        keep = [w.detach() for layer in plan.layers(state) for w in layer if w is not None]   # weights stay alive
        keep += [getattr(plan.rotary, "_cos", None), getattr(plan.rotary, "_sin_signed", None),
                 getattr(state, "feature_map", None)]
        return _Captured(graph, static_tokens, slot, logits, keep)
