"""Decoding states on disk: a safetensors file with the model's identity and the position recorded.

    saved = SavedState(state, ids, next_ids)   # a batch-1 state holding `ids`; `next_ids` go in next
    save(path, saved, model)                   # a temporary file beside it, then renamed: never half a file
    saved = load(path, model, max_len=...)     # refused (StateMismatchError) for another model or shape

A state holds every token of a sequence but the last ones, `next_ids` (at least one), which the
next generation feeds first: its logits are the next token's, so continuing from a loaded state
gives the tokens an uninterrupted run gives (`LLM.prefill`, `LLM.resume`).

File layout: tensors `state.<name>` (the state's `state_dict()` tensors: a KV cache cut to the
slots written; S and z for the linear path; S, z and the window's keys for a window state; each part's,
prefixed `0.`/`1.`, for a hybrid); metadata `format`, `state` (path, shapes, dtype,
feature map, slots, lengths, padded: JSON), `model` (the model's identity: its config's hash and
a fingerprint of its weights, JSON), `ids` and `next_ids` (JSON).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from safetensors import SafetensorError
from safetensors.torch import safe_open

from engine.attention import STATES, saved_state_class
from engine.errors import CheckpointError, StateMismatchError
from models.weights import save_safetensors

FORMAT = "gen-state/1"


@dataclass
class SavedState:
    state: object               # a batch-1 State (KVState, LinearState, WindowState or HybridState)
    ids: list[int]              # the tokens it holds, in order
    next_ids: list[int]         # the tokens after them, not in the state yet (at least one)


def model_identity(model) -> dict:
    """What a state must have been made by: the config (hashed) and a fingerprint of the weights."""
    # the default path and feature map are choices made at load time, not the model: the state's own
    # identity (path, feature map, shapes) is checked on its own
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("attention", "feature_map")}
    cfg = json.dumps(fields, sort_keys=True, default=str)
    h = hashlib.sha256()
    parts = [model.norm.weight, model.embed_tokens.weight[:4], model.layers[-1].mlp.down_proj.weight[:4]]
    if model.hedgehog is not None:                      # learned maps (gen linearize)
        parts.append(model.hedgehog.k_weight[:, :1, :1])
    parts += [m.weight[:4] for m in model.adapted_modules()[:2]]   # layer 0's adapters (engine.adapters)
    for t in parts:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return {"config_sha256": hashlib.sha256(cfg.encode()).hexdigest(), "weights_sha256": h.hexdigest(),
            "layers": model.config.num_hidden_layers, "vocab_size": model.config.vocab_size}


def save(path: str | os.PathLike, saved: SavedState, model) -> None:
    if saved.state.batch_size != 1:
        raise StateMismatchError(f"save a state of one sequence; this one holds {saved.state.batch_size}")
    if not saved.next_ids:
        raise StateMismatchError("a saved state needs the token(s) to feed next (next_ids); see LLM.prefill")
    sd = saved.state.state_dict()
    tensors = {f"state.{k}": v.contiguous() for k, v in sd["tensors"].items()}
    meta = {"format": FORMAT, "state": json.dumps(sd["meta"]), "model": json.dumps(model_identity(model)),
            "ids": json.dumps([int(i) for i in saved.ids]), "next_ids": json.dumps([int(i) for i in saved.next_ids])}
    save_safetensors(tensors, path, metadata=meta, private=True)   # a state holds a conversation: 0600


def load(path: str | os.PathLike, model, max_len: int | None = None, device=None, spec=None) -> SavedState:
    """Read a saved state for `model`; a KV cache gets capacity `max_len` (default: its slots). spec: the
    run that will continue it (checked before the state is allocated: `check_same_run`)."""
    path = os.fspath(path)
    if os.path.isdir(path):   # safetensors says only "No such device (os error 19)"
        raise CheckpointError(f"{path}: is a directory; give the file llm.save_state() wrote")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a saved decoding state (format {meta.get('format')!r}, "
                              f"expected {FORMAT!r}); save one with llm.save_state()")
    theirs, mine = json.loads(meta["model"]), model_identity(model)
    if theirs != mine:
        what = "configuration" if theirs["config_sha256"] != mine["config_sha256"] else "weights"
        raise StateMismatchError(f"{path}: saved from another model (its {what} differ: {theirs['layers']} layers, "
                                 f"vocabulary {theirs['vocab_size']} there, {mine['layers']} and "
                                 f"{mine['vocab_size']} here); load it with the model it was saved from")
    state_meta = json.loads(meta["state"])
    here = str(model.dtype).removeprefix("torch.")
    kv_here = str(model.kv_dtype or model.dtype).removeprefix("torch.")
    for part_path, dtype in cache_dtypes(state_meta):
        want = kv_here if part_path == "softmax" else here
        if dtype != want:
            what = "KV cache" if part_path == "softmax" else "window of keys"
            fix = f"kv_dtype={dtype}" if part_path == "softmax" else f"dtype={dtype}"
            raise StateMismatchError(f"{path}: a {dtype} {what}, but this model keeps it in {want}; load the "
                                     f"model with {fix}")
    if spec is not None:
        check_same_run(state_meta, model, spec, path)
    sd = {"meta": state_meta,
          "tensors": {k.removeprefix("state."): v for k, v in tensors.items() if k.startswith("state.")}}
    device = device or model.device
    kind = saved_state_class(state_meta, STATES)
    # linear layers run the model's own feature map object (its learned maps for "hedgehog"), not a copy by name
    name = state_meta.get("feature_map") or state_meta.get("parts", [{}])[-1].get("feature_map")
    extra = {"feature_map": model.feature_map(name)} if name else {}
    state = kind.from_state_dict(sd, max_len=max_len, device=device, **extra)
    return SavedState(state, json.loads(meta["ids"]), json.loads(meta["next_ids"]))


_NOT_THE_RUN = frozenset({"slots", "padded", "batch", "dtype", "window_dtype"})   # what a state holds, not how it runs


def run_of(state_meta: dict):
    """What of a state's metadata decides how it decodes (paths per layer, window, sparse keys, feature
    map, shapes): equal for two states exactly when one run could continue the other."""
    if isinstance(state_meta, dict):
        return {k: run_of(v) for k, v in state_meta.items() if k not in _NOT_THE_RUN}
    if isinstance(state_meta, list):
        return [run_of(v) for v in state_meta]
    return state_meta


def describe_run(state_meta: dict) -> str:
    """A state's run in gen's words: "linear, window 4", "hybrid (softmax layers 1), window 4, 2 sparse keys"."""
    parts = state_meta.get("parts") or [state_meta]
    linear = next((p for p in parts if p.get("path") != "softmax"), {})
    if state_meta.get("path") == "hybrid":
        soft = [i for i, p in enumerate(state_meta.get("layer_paths", ())) if p == "softmax"]
        out = f"hybrid (softmax layers {','.join(map(str, soft))})"
    else:
        out = "linear" if state_meta.get("path") == "window" else str(state_meta.get("path"))
    if linear.get("window"):
        out += f", window {linear['window']}"
    if linear.get("sparse_keys"):
        out += f", {linear['sparse_keys']} sparse keys"
    if linear.get("feature_map"):
        out += f", feature map {linear['feature_map']}"
    return out


def check_same_run(state, model, spec, what: str) -> None:
    """StateMismatchError unless `state` is what `model` run as `spec` makes (a state of another run would
    decode as that run, whatever this LLM was loaded as)."""
    theirs = state if isinstance(state, dict) else state.identity()   # (a saved file's metadata, or a state's)
    mine = model.init_state(batch=1, max_len=1, spec=spec).identity()
    if run_of(theirs) != run_of(mine):
        if describe_run(theirs) == describe_run(mine):   # the same run: the shapes differ
            raise StateMismatchError(f"{what}: the state is another model's (its layers or heads differ); continue it "
                                     "with the model it was made with")
        raise StateMismatchError(f"{what}: the state is of a {describe_run(theirs)} run; this LLM runs "
                                 f"{describe_run(mine)}: load the model with the options the state was made with")


def cache_dtypes(state_meta: dict) -> list[tuple[str, str]]:
    """(part path, dtype) of a saved state's tensors kept in a model-chosen dtype: KV caches (the
    model's kv_dtype, default its dtype) and windows of keys (the model's dtype)."""
    out = []
    for part in state_meta.get("parts", [state_meta]):
        if part["path"] == "softmax":
            out.append(("softmax", part["dtype"]))
        elif part["path"] == "window":
            out.append(("window", part["window_dtype"]))
    return out
