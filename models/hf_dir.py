"""Hugging Face layout directories on disk: read (single file or shards, memory-mapped), write (streamed).

    DIR/config.json
    DIR/model.safetensors                                   one file, or
    DIR/model.safetensors.index.json + model-0000i-of-0000n.safetensors   shards
    DIR/tokenizer.model                                     optional
    DIR/generation_config.json                              optional: its eos_token_id joins the config's

Reading never copies: `safe_open` maps the file and hands out views of it. Names are checked
against the config here; mapping them onto the runtime model is `models.weights`' job.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from models.errors import CheckpointError
from models.generation_config import FILE as GENERATION_CONFIG, read_file as read_generation_file
from models.config import ModelConfig
from models.replace import replacing
from models.weights import check_tensors, hf_shapes

SINGLE = "model.safetensors"

# What a model directory holds (`gen convert --force`, `gen train --export --force` remove these, and
# nothing else, before writing a model there): a Hugging Face layout's files, and a `gen linearize`
# output's (its maps and adapters would apply to the new model).
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "model-*-of-*.safetensors", "*.safetensors.tmp", ".*.tmp", "tokenizer.model", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md",
               "maps.safetensors", "adapters.safetensors", "linearize.json", "transfer_losses.json", "data.json")


def remove_model_files(directory: str | os.PathLike, keep=()) -> None:
    """Remove an older model's files (MODEL_FILES) from `directory`, but none that is one of `keep` (paths:
    e.g. the tokenizer the new model takes from there); no file of the old model survives beside the new."""
    directory = Path(directory)
    keep = [Path(k) for k in keep if k and Path(k).exists()]
    for name in MODEL_FILES if directory.is_dir() else ():
        for p in directory.glob(name):
            if not any(p.samefile(k) for k in keep):
                p.unlink()
INDEX = "model.safetensors.index.json"


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and every tensor the config needs (memory-mapped views), checked for name and shape."""
    path = Path(path)
    cfg = with_generation_eos(ModelConfig.from_json(path / "config.json"), path)
    if (path / SINGLE).is_file():
        shards = {SINGLE: list(hf_shapes(cfg))}      # extra tensors (rotary caches...) are ignored
        where = path / SINGLE
    elif (path / INDEX).is_file():
        shards = _read_index(path / INDEX, cfg)
        where = path / INDEX
    else:
        hint = " (pytorch_model.bin is not supported: save with safetensors)" \
            if (path / "pytorch_model.bin").exists() else ""
        raise CheckpointError(f"{path}: no {SINGLE} or {INDEX}{hint}")
    tensors = {}
    for shard, names in shards.items():
        tensors.update(_read_safetensors(path / shard, names))
    check_tensors(tensors, cfg, str(where))
    return cfg, tensors


def with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """cfg with generation_config.json's EOS ids added to its own (Qwen2.5-Instruct: config.json says
    <|im_end|>, generation_config.json [<|im_end|>, <|endoftext|>]; Llama 3 Instruct lists <|eot_id|>
    there): transformers' generate stops at those, so a reply must end here at the same ids."""
    file = path / GENERATION_CONFIG
    eos = read_generation_file(path).get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        if eos is None:
            return cfg
        raise CheckpointError(f"{file}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    ids = list(dict.fromkeys([*cfg.eos_ids, *eos]))
    return cfg if len(ids) == len(cfg.eos_ids) else cfg.replace(eos_token_id=tuple(ids))


def _read_index(index: Path, cfg: ModelConfig) -> dict[str, list[str]]:
    """shard file -> names of the tensors we need from it."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    shards: dict[str, list[str]] = {}
    for name in hf_shapes(cfg):
        if name not in weight_map:
            raise CheckpointError(f"{index}: missing tensor {name}")
        shard = weight_map[name]
        if not (index.parent / shard).is_file():
            raise CheckpointError(f"{index}: shard {shard} (holding {name}) not found")
        shards.setdefault(shard, []).append(name)
    return shards


def _read_safetensors(file: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of one file, as views of its memory map."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise CheckpointError(f"{file}: missing tensor {name}")
            return {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: truncated or corrupt safetensors file "
                              f"({str(e).splitlines()[0]})") from None


# ---------------------------------------------------------------------------- writing
DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def write_safetensors(file: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      shapes: dict[str, tuple[int, ...]] | None = None,
                      metadata: dict[str, str] | None = None, progress=None) -> None:
    """Stream `tensors` into a safetensors `file`, one tensor materialised at a time.

    shapes: the shape to record for a name when it differs from the tensor's (a permuted view such
    as `interleaved_to_half`'s is made contiguous and reshaped as it is written). So converting a
    memory-mapped checkpoint never holds a second copy of the model. `progress` (tqdm-like,
    .update(n)) advances by each tensor's byte count.
    """
    file, shapes = os.fspath(file), shapes or {}
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for name, t in tensors.items():
        shape = tuple(shapes.get(name, t.shape))
        if torch.Size(shape).numel() != t.numel():
            raise ValueError(f"{name}: shape {list(shape)} does not fit {t.numel()} elements")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                       # tensor data starts 8-byte aligned
    with replacing(file) as tmp, open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            t = t.detach().to("cpu").contiguous()
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            if progress is not None:
                progress.update(t.numel() * t.element_size())
