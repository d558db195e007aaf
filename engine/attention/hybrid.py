"""Hybrid layers: some layers keep a KV cache, the rest run as linear RNNs, on the same weights.

    state = HybridState.allocate(cfg, batch, max_len, device, dtype, feature_map=fmap,
                                 layer_attention=("linear", "softmax", ...), window=0)

One state object holds the per-layer mix: a KVState over the softmax layers and a LinearState
(or, with a window, a WindowState) over the linear ones, each told which model layers it serves.
It implements the same protocol (open/attend/commit/tensors/nbytes), so the generation loop and
the step forms stay blind to it; `layer_paths` says per layer which path runs (rotary decisions).

`allocate_state` is the one place that turns (path, per-layer mix, window) into a state class.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.attention.base import Span, State
from engine.attention.linear import LinearState
from engine.attention.packed import Packed
from engine.attention.sliding import SlidingKVState
from engine.attention.softmax import KVState
from engine.attention.sparse import BLOCK as SPARSE_BLOCK, SparseWindowState
from engine.attention.window import WindowState
from engine.errors import InvalidArgumentError
from engine.runspec import (HYBRID_NEEDS_LAYERS, check_attention, highest_loss_layers, layer_attention_for,  # noqa: F401
                            parse_softmax_layers, resolve_mode)

LAYER_PATHS = ("softmax", "linear")
PART_STATES = {"softmax": KVState, "linear": LinearState, "window": WindowState}


def saved_state_class(meta: dict, states: dict = PART_STATES):
    """The state class a saved state's meta names: by its path, and a softmax state whose identity names a
    window is a sliding-window ring (SlidingKVState). `states`: the classes by path (the package's STATES
    adds the hybrid)."""
    if meta.get("path") == "softmax" and meta.get("softmax_window"):
        return SlidingKVState
    if meta.get("path") == "window" and meta.get("sparse_keys"):
        return SparseWindowState
    return states[meta["path"]]


@dataclass(eq=False)
class HybridState(State):
    parts: list = None                 # sub-states: the KVState first (if any), then the linear one
    where: list = None                 # per model layer: (index into parts, layer inside that part)
    layer_paths: tuple = ()            # per model layer: "softmax" or the linear part's path

    path = "hybrid"

    @classmethod
    def allocate(cls, cfg, batch: int, max_len, device, dtype, feature_map=None, layer_attention=None,
                 window: int = 0, kv_dtype=None, sparse_keys: int = 0) -> "HybridState":
        soft = [i for i, p in enumerate(layer_attention) if p == "softmax"]
        lin = [i for i, p in enumerate(layer_attention) if p != "softmax"]
        parts, where = [], [None] * len(layer_attention)
        if soft:
            sub = cfg.replace(num_hidden_layers=len(soft), attention="softmax", layer_attention=None,
                              transfer_loss=None)
            parts.append(kv_state(sub).allocate(sub, batch, max_len, device, kv_dtype or dtype))
            for j, i in enumerate(soft):
                where[i] = (0, j)
        if lin:
            parts.append(linear_state(cfg, batch, max_len, device, dtype, feature_map, window, sparse_keys, lin))
            for j, i in enumerate(lin):
                where[i] = (len(parts) - 1, j)
        paths = tuple("softmax" if p == "softmax" else parts[-1].path for p in layer_attention)
        return cls(lengths=parts[0].lengths.clone(), slots=0, parts=parts, where=where, layer_paths=paths)

    @property
    def max_len(self):
        return self.parts[0].max_len if self.parts[0].path == "softmax" else None

    @property
    def feature_map(self):
        return getattr(self.parts[-1], "feature_map", None)

    def open(self, tokens, real=None) -> Span:
        self._spans = [p.open(tokens, real) for p in self.parts]   # the KV part checks capacity first
        self.padded = any(p.padded for p in self.parts)
        return self._spans[-1]

    def attend(self, layer: int, q, k, v, span):
        part, j = self.where[layer]
        return self.parts[part].attend(j, q, k, v, self._spans[part])

    def commit(self, span):
        for p, s in zip(self.parts, self._spans):
            p.commit(s)
        super().commit(span)

    def tensors(self):
        return [t for p in self.parts for t in p.tensors()]

    # ------------------------------------------------------------------ saving and batching
    # Every part holds the same rows with the same lengths. The KV part (first, when there is one) decides
    # `slots` (its rows are right-aligned after a concat); the linear part's slots only set rotary positions
    # of unpadded batches, so after regrouping every part is given the hybrid's slots and `padded`.
    def identity(self) -> dict:
        return {"path": self.path, "layer_paths": list(self.layer_paths), "parts": [p.identity() for p in self.parts]}

    def _saved_tensors(self):
        return {f"{i}.{name}": t for i, p in enumerate(self.parts) for name, t in p._saved_tensors().items()}

    def _load_tensors(self, tensors, slots):
        for i, p in enumerate(self.parts):
            p._load_tensors({k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith(f"{i}.")}, slots)

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self._share_position()

    def _share_position(self) -> None:
        for p in self.parts:
            p.lengths, p.slots, p.padded = self.lengths.clone(), self.slots, self.padded

    def packed(self) -> Packed:
        """Each part packed on its own (a KV part as it is)."""
        return Packed(self, parts=[p.packed() for p in self.parts])

    def _regrouped(self, parts: list) -> "HybridState":
        out = HybridState(lengths=parts[0].lengths.clone(), slots=parts[0].slots, parts=parts, where=self.where,
                          layer_paths=self.layer_paths)
        out._after_regroup()
        out._share_position()
        return out

    def select_rows(self, idx, max_len=None) -> "HybridState":
        idx = list(idx)
        return self._regrouped([p.select_rows(idx, max_len) for p in self.parts])

    @classmethod
    def concat(cls, states, max_len=None) -> "HybridState":
        cls.check_same_identity(states, "layer mixes, shapes, dtypes or feature maps")
        first = states[0]
        return first._regrouped([type(p).concat([s.parts[i] for s in states], max_len)
                                 for i, p in enumerate(first.parts)])

    @classmethod
    def from_state_dict(cls, sd, max_len: int | None = None, device=None, feature_map=None) -> "HybridState":
        """A new state from `state_dict()` output; the KV part gets capacity `max_len` (default: the slots
        saved). feature_map: the map object the linear layers run (a model's learned maps); default: by name."""
        meta, tensors = sd["meta"], sd["tensors"]
        position = {k: meta[k] for k in ("slots", "padded", "batch")}
        parts = []
        for i, ident in enumerate(meta["parts"]):
            sub = {"meta": dict(ident, **position),
                   "tensors": dict({k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith(f"{i}.")},
                                   lengths=tensors["lengths"])}
            parts.append(saved_state_class(ident).from_state_dict(sub, max_len=max_len, device=device,
                                                                  feature_map=feature_map))
        paths = tuple(meta["layer_paths"])
        where, count = [], [0] * len(parts)
        for p in paths:   # the KV part serves the softmax layers in order, the last part the others
            i = 0 if p == "softmax" else len(parts) - 1
            where.append((i, count[i]))
            count[i] += 1
        out = cls(lengths=parts[0].lengths.clone(), slots=int(meta["slots"]), parts=parts, where=where,
                  layer_paths=paths, padded=bool(meta["padded"]))
        out._share_position()
        return out


def kv_state(cfg) -> type:
    """The state class of softmax layers: a ring of the sliding window (Mistral's) where the config has one."""
    return SlidingKVState if cfg.softmax_window else KVState


def held_keys(window: int, sparse_keys: int) -> int:
    """Keys and values a linear layer's state holds exactly per key/value head."""
    return window + SPARSE_BLOCK - 1 + sparse_keys if window and sparse_keys else window


def linear_state(cfg, batch: int, max_len, device, dtype, feature_map, window: int, sparse_keys: int,
                 layers=None) -> State:
    """The state of linear layers: LinearState, with a window WindowState, with a window and a sparse
    cache of hard keys SparseWindowState."""
    if window and sparse_keys:
        return SparseWindowState.allocate(cfg, batch, max_len, device, dtype, feature_map=feature_map, layers=layers,
                                          window=window, sparse_keys=sparse_keys)
    if window:
        return WindowState.allocate(cfg, batch, max_len, device, dtype, feature_map=feature_map, layers=layers,
                                    window=window)
    return LinearState.allocate(cfg, batch, max_len, device, dtype, feature_map=feature_map, layers=layers)


def allocate_state(cfg, path: str, batch: int, max_len, device, dtype, feature_map=None,
                   layer_attention=None, window: int = 0, kv_dtype=None, sparse_keys: int = 0) -> State:
    """The state for `path` ("softmax", "linear", "hybrid"); a window turns linear layers into WindowState
    (SparseWindowState with `sparse_keys`). kv_dtype: the KV cache's dtype (default `dtype`), e.g.
    float16 under fp32 weights as llama.cpp keeps it."""
    check_attention(path)
    if path == "softmax":
        return kv_state(cfg).allocate(cfg, batch, max_len, device, kv_dtype or dtype)
    if path == "linear":
        return linear_state(cfg, batch, max_len, device, dtype, feature_map, window, sparse_keys)
    if layer_attention is None:
        raise InvalidArgumentError(HYBRID_NEEDS_LAYERS)
    return HybridState.allocate(cfg, batch, max_len, device, dtype, feature_map=feature_map,
                                layer_attention=layer_attention, window=window, kv_dtype=kv_dtype,
                                sparse_keys=sparse_keys)


def state_bytes(cfg, layer_attention, context: int, batch: int = 1, dtype_bytes: int = 4,
                feature_dim: int | None = None, window: int = 0, kv_bytes: int | None = None,
                sparse_keys: int = 0) -> int:
    """The per-layer formula of a (hybrid) state's bytes at `context` tokens (what `nbytes` reports).

    softmax layer: 2 * Hkv * context * D * kv_bytes (KV cache at capacity `context`; kv_bytes
    defaults to dtype_bytes); linear layer: Hkv * (F * D + F) * 4 (fp32 S and z) + 2 * Hkv * W * D *
    dtype_bytes (the window; with a sparse cache of M keys, W + 63 recent keys and M cached ones).
    """
    D, Hkv = cfg.head_dim, cfg.num_key_value_heads
    F_ = feature_dim if feature_dim is not None else D
    per = {"softmax": 2 * Hkv * context * D * (kv_bytes or dtype_bytes),
           "linear": Hkv * (F_ * D + F_) * 4 + 2 * Hkv * held_keys(window, sparse_keys) * D * dtype_bytes}
    return batch * sum(per[p] for p in layer_attention)


def runtime_config(cfg, attention: str | None = None, softmax_layers=None, window: int | None = None):
    """The config a run asks for on the same weights: `cfg` with the attention, layers and window of
    `RunSpec.resolve(cfg, attention=..., softmax_layers=..., window=...)` (engine.runspec, where the
    rules live). Kept for callers that want a ModelConfig; nothing given: `cfg` itself."""
    if attention is None and softmax_layers is None and window is None:
        return cfg
    mode = resolve_mode(cfg, attention, softmax_layers, window)
    return cfg.replace(attention=mode["attention"], layer_attention=mode["layer_attention"], window=mode["window"])
