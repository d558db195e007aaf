"""A checkpoint's own sampling defaults: Hugging Face `generation_config.json`, or a GGUF's
`general.sampling.*` keys (which llama.cpp's converter copies from that file).

    read_generation_config(directory)  -> {"temperature": 0.6, "top_p": 0.9}   (only the keys it names)
    gguf_sampling(meta)                -> the same, from GGUF metadata

Five keys are read, under the engine's setting names: temperature, top_k, top_p, min_p,
repetition_penalty. As in vLLM, `do_sample` is not read (a file naming a temperature means it).
Ranges are the sampler's to check (engine.sampling); here only the types.
"""
from __future__ import annotations

import json
from pathlib import Path

from models.errors import CheckpointError

FILE = "generation_config.json"
KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


def read_file(directory: str | Path) -> dict:
    """A directory's generation_config.json as a dict ({} without the file; CheckpointError when it is
    not a JSON object). Its EOS ids are models.hf_dir's (with_generation_eos), its sampling keys ours."""
    path = Path(directory) / FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object (got {type(raw).__name__})")
    return raw


def read_generation_config(directory: str | Path) -> dict:
    """The sampling keys a directory's generation_config.json names ({} without the file)."""
    raw = read_file(directory)
    return _checked({k: raw.get(k) for k in KEYS}, str(Path(directory) / FILE))


def gguf_sampling(meta: dict, where: str = "") -> dict:
    """The sampling keys a GGUF file's metadata names ({} when it names none)."""
    return _checked({name: meta.get(key) for key, name in GGUF_KEYS.items()}, where)


def _checked(values: dict, where: str) -> dict:
    out = {}
    for name, value in values.items():
        if value is None:
            continue
        kind = KEYS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise CheckpointError(f"{where}: {name} must be a{'n integer' if kind is int else ' number'}, "
                                  f"got {value!r:.40}")
        out[name] = kind(value)
    return out
