"""A linearized model on disk: learned feature maps beside a pointer to the base model.

    DIR/config.json          {"base_model": "smollm2", "feature_map": "hedgehog", "attention": "linear",
                              "layer_attention": [...] (optional), "window": 0, "transfer_loss": [...]}
    DIR/maps.safetensors     the learned maps (fp16), names below
    DIR/adapters.safetensors low-rank adapters of the linear layers' q/k/v and o projections (fp16,
                             optional: `gen linearize --lora-rank R`; engine.adapters), names below
    DIR/transfer_losses.json per layer: absolute and relative transfer loss (written by gen linearize)
    DIR/data.json            the training data used
    DIR/<sub>/               optional: maps (and adapters) trained for one other configuration, a whole
                             `gen linearize` output of its own; config.json's "variants" names it,
                             e.g. {"no_window": "linear"}: what runs without a window load

A softmax control (`gen linearize --control`) is the same finetune with softmax attention: config.json
{"base_model": ..., "attention": "softmax", "adapters_on": "all", "lora_rank": R}, adapters.safetensors,
no maps: its adapters go into every layer's own projections.

Checkpoint names <-> runtime names of the maps, in one place (runtime: `Transformer.hedgehog`):

    feature_map.q.weight  (L, H, D, D)     hedgehog.q_weight
    feature_map.q.bias    (L, H, D)        hedgehog.q_bias
    feature_map.k.weight  (L, Hkv, D, D)   hedgehog.k_weight
    feature_map.k.bias    (L, Hkv, D)      hedgehog.k_bias
    feature_map.decay     (L, Hkv, 2D)     hedgehog.decay_logit  (optional, `gen linearize --decay`:
                                           log decay = -sigmoid(this), per key/value head and feature)
    feature_map.gate      (L, Hkv, D, 2D)  hedgehog.gate_weight  (optional, with the decay; `gen linearize
                                           --gate`: the decay's dependence on the token's value)

    adapter.qkv.a         (L, R, C)              qkv_a
    adapter.qkv.b         (L, (H + 2 Hkv) D, R)  qkv_b   (B holds the scale: delta W = B A)
    adapter.o.a           (L, R, H D)            o_a
    adapter.o.b           (L, C, R)              o_b
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from models.config import LAYER_PATHS, ModelConfig
from models.errors import CheckpointError
from models.replace import replacing
from models.weights import save_safetensors

CONFIG, MAPS, ADAPTERS = "config.json", "maps.safetensors", "adapters.safetensors"
ADAPTER_NAMES = {"adapter.qkv.a": "qkv_a", "adapter.qkv.b": "qkv_b", "adapter.o.a": "o_a", "adapter.o.b": "o_b"}
MAP_NAMES = {"feature_map.q.weight": "hedgehog.q_weight", "feature_map.q.bias": "hedgehog.q_bias",
             "feature_map.k.weight": "hedgehog.k_weight", "feature_map.k.bias": "hedgehog.k_bias",
             "feature_map.decay": "hedgehog.decay_logit", "feature_map.gate": "hedgehog.gate_weight"}
DECAY, GATE = "feature_map.decay", "feature_map.gate"   # the optional map tensors (a gate needs the decay)
# the keys of DIR/config.json that override the base model's config
OVERRIDES = ("feature_map", "attention", "layer_attention", "window", "sparse_keys", "transfer_loss")
# configurations a directory may ship a second set of maps for (config.json "variants"):
# "no_window" = every run whose linear layers have no window (`--attention linear` without
# `--window`, hybrids without it); which one a run takes is the engine's choice (engine.loader)
VARIANTS = ("no_window",)


def map_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, H, Hkv, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {"feature_map.q.weight": (L, H, D, D), "feature_map.q.bias": (L, H, D),
            "feature_map.k.weight": (L, Hkv, D, D), "feature_map.k.bias": (L, Hkv, D)}


def adapter_shapes(cfg: ModelConfig, rank: int) -> dict[str, tuple[int, ...]]:
    L, H, Hkv, D, C = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.hidden_size)
    return {"adapter.qkv.a": (L, rank, C), "adapter.qkv.b": (L, (H + 2 * Hkv) * D, rank),
            "adapter.o.a": (L, rank, H * D), "adapter.o.b": (L, C, rank)}


def is_linearized(path: str | os.PathLike) -> bool:
    """A directory whose config.json points at a base model (rather than holding a whole model)."""
    cfg = Path(path) / CONFIG
    if not cfg.is_file():
        return False
    try:
        return "base_model" in json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def read_linearized_config(path: str | os.PathLike) -> dict:
    raw = json.loads((Path(path) / CONFIG).read_text(encoding="utf-8"))
    if not isinstance(raw.get("base_model"), str):
        raise CheckpointError(f"{Path(path) / CONFIG}: base_model must name the base model (e.g. \"smollm2\")")
    return raw


def variant_sets(path: str | os.PathLike, raw: dict) -> dict[str, Path]:
    """The other sets of maps the directory ships (config.json "variants": configuration -> a
    subdirectory holding a whole `gen linearize` output made from the same base model), checked;
    a bad entry is a one-line CheckpointError."""
    where = Path(path) / CONFIG
    variants = raw.get("variants", {})
    if not isinstance(variants, dict) or any(k not in VARIANTS or not isinstance(v, str) for k, v in variants.items()):
        raise CheckpointError(f"{where}: \"variants\" maps a configuration ({', '.join(VARIANTS)}) to a "
                              f"subdirectory, got {variants!r}")
    sets = {}
    for name, sub in variants.items():
        sub = Path(path) / sub
        if not (sub / CONFIG).is_file() or not (sub / MAPS).is_file():
            raise CheckpointError(f"{where}: names {sub} for {name}, but it holds no {CONFIG} and {MAPS}; copy "
                                  f"that `gen linearize` output there (or drop the entry)")
        if read_linearized_config(sub)["base_model"] != raw["base_model"]:
            raise CheckpointError(f"{sub / CONFIG}: made from another base model than {where}'s "
                                  f"{raw['base_model']!r}: these maps belong to another model")
        sets[name] = sub
    return sets


def apply_linearized(base_cfg: ModelConfig, raw: dict, path: str | os.PathLike) -> tuple[ModelConfig, dict, dict | None]:
    """The base config with the linearized dir's overrides, the maps and the adapters (None: the
    directory has none) under runtime names, checked."""
    where = Path(path) / CONFIG
    changes = {k: raw[k] for k in OVERRIDES if k in raw}
    control = adapters_on(raw, where) == "all"
    trained = base_cfg.trained_for if control else tuple(dict.fromkeys(base_cfg.trained_for + ("linear", "hybrid")))
    cfg = ModelConfig.from_dict({**base_cfg.to_dict(), **changes, "trained_for": list(trained)}, where=str(where))
    return (cfg, *read_set(path, cfg, raw))


def adapters_on(raw: dict, where) -> str:
    """Which layers read a directory's adapters: "linear" (those run linear; a linearized model) or
    "all" (every layer's own projections; a softmax control)."""
    on = raw.get("adapters_on", "linear")
    if on not in ("linear", "all"):
        raise CheckpointError(f"{where}: adapters_on must be \"linear\" or \"all\", got {on!r}")
    return on


def read_set(path: str | os.PathLike, cfg: ModelConfig, raw: dict | None = None) -> tuple[dict | None, dict | None]:
    """One set of learned maps and adapters (None: the set has none) of directory `path`, under
    runtime names, checked against `cfg` (the model they run on). A softmax control has no maps."""
    raw = read_linearized_config(path) if raw is None else raw
    where = Path(path) / CONFIG
    adapters, rank = Path(path) / ADAPTERS, raw.get("lora_rank")
    if rank and not adapters.is_file():
        raise CheckpointError(f"{where}: names rank-{rank} adapters, but {adapters} is missing; copy it beside "
                              f"config.json (or remove lora_rank to run the maps alone)")
    found = read_adapters(adapters, cfg) if adapters.is_file() else None
    if found is not None and rank is not None and found["qkv_a"].shape[1] != rank:
        raise CheckpointError(f"{adapters}: rank {found['qkv_a'].shape[1]} adapters, but {where} names rank {rank}")
    if adapters_on(raw, where) == "all":
        if found is None:
            raise CheckpointError(f"{where}: a softmax control (adapters_on all) needs {adapters}")
        return None, found
    return read_maps(Path(path) / MAPS, cfg), found


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _checked(file: Path, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
             names: dict[str, str], what: str, detail: str) -> dict[str, torch.Tensor]:
    """`file`'s tensors under runtime `names`, each of its shape in `shapes` (one-line CheckpointError)."""
    out = {}
    for name, shape in shapes.items():
        if name not in tensors:
            raise CheckpointError(f"{file}: missing tensor {name}")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise CheckpointError(f"{file}: tensor {name} has shape {list(found)}, but the base model needs "
                                  f"{list(shape)} ({detail}): these {what} belong to another model")
        out[names[name]] = tensors[name]
    return out


def _write_named(file: str | os.PathLike, runtime: dict[str, torch.Tensor], names: dict[str, str], dtype) -> None:
    """Save the runtime-named tensors that `names` maps, under checkpoint names, atomically."""
    inverse = {v: k for k, v in names.items()}
    tensors = {inverse[k]: v.detach().to("cpu", dtype).contiguous() for k, v in runtime.items() if k in inverse}
    save_safetensors(tensors, file)


def read_adapters(file: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Low-rank adapters of `file` under runtime names, each checked against `cfg` (one-line CheckpointError)."""
    file = Path(file)
    tensors = _read_safetensors(file)
    a = tensors.get("adapter.qkv.a")
    rank = a.shape[1] if a is not None and a.dim() == 3 and a.shape[1] > 0 else 1
    out = _checked(file, tensors, adapter_shapes(cfg, rank), ADAPTER_NAMES, "adapters",
                   f"{cfg.num_hidden_layers} layers, rank {rank}")
    return {k: v.float() for k, v in out.items()}


def write_adapters(file: str | os.PathLike, runtime: dict[str, torch.Tensor], dtype=torch.float16) -> None:
    """Save runtime-named adapters (`qkv_a`, ...) under checkpoint names, atomically."""
    _write_named(file, runtime, ADAPTER_NAMES, dtype)


def read_maps(file: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The maps of `file` under runtime names, each checked against `cfg` (one-line CheckpointError)."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file; a linearized model directory needs its maps")
    tensors = _read_safetensors(file)
    shapes = map_shapes(cfg)
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    if DECAY in tensors or GATE in tensors:
        shapes[DECAY] = (L, Hkv, 2 * D)
    if GATE in tensors:
        shapes[GATE] = (L, Hkv, D, 2 * D)
    return _checked(file, tensors, shapes, MAP_NAMES, "maps", f"{cfg.num_hidden_layers} layers")


def write_maps(file: str | os.PathLike, runtime: dict[str, torch.Tensor], dtype=torch.float16) -> None:
    """Save runtime-named maps (`hedgehog.q_weight`, ...) under checkpoint names, atomically."""
    _write_named(file, runtime, MAP_NAMES, dtype)


def write_json(file: str | os.PathLike, obj) -> None:
    with replacing(file) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps_records(obj) + "\n")


def dumps_records(obj) -> str:
    """JSON as `indent=2` writes it, except that a top-level list of records (transfer_losses.json's
    layers, a log's steps) keeps one record per line: a file of a few lines per layer, not ten."""
    if not isinstance(obj, dict):
        return json.dumps(obj, indent=2)
    items = []
    for key, value in obj.items():
        if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            body = ",\n    ".join(json.dumps(x) for x in value)
            items.append(f"  {json.dumps(key)}: [\n    {body}\n  ]")
        else:
            items.append(f"  {json.dumps(key)}: " + json.dumps(value, indent=2).replace("\n", "\n  "))
    return "{\n" + ",\n".join(items) + "\n}" if items else "{}"


__all__ = ["CONFIG", "MAPS", "ADAPTERS", "VARIANTS", "MAP_NAMES", "ADAPTER_NAMES", "adapter_shapes", "read_adapters",
           "write_adapters", "LAYER_PATHS", "map_shapes", "is_linearized", "read_linearized_config",
           "apply_linearized", "variant_sets", "read_set", "read_maps", "write_maps",
           "write_json", "DECAY", "GATE"]
