"""Named models and checkpoint files on disk: what a `--model` argument points at, read from disk.

    resolve("tiny")                 -> weights/tiny (a registered name) or the path given
    read_checkpoint(path)           -> Checkpoint(config, Hugging Face-named tensors, tokenizer, ...)

A path is a Hugging Face layout directory (`models.hf_dir`) or a llama2.c file (`models.llama2c`).
Every reader hands back memory-mapped tensors under Hugging Face names; turning them into a
runtime model is the engine's job (`engine.loader.build`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from models.config import ModelConfig
from models.errors import CheckpointError, InvalidArgumentError
from models.hf_dir import read_hf_dir
from models.llama2c import read_llama2c
from models.tokenizer import Tokenizer

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
REGISTRY = {"tiny": WEIGHTS_DIR / "tiny"}


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]     # Hugging Face names -> (memory-mapped) tensors
    tokenizer: object | None             # models.tokenizer.Tokenizer or None
    interleaved_rotary: bool = False     # q/k rows in Meta's interleaved layout (llama2.c)
    path: Path | None = None


def resolve(model: str | os.PathLike) -> Path:
    """A registered name or an existing path; otherwise an error listing the known names."""
    if isinstance(model, str) and model in REGISTRY:
        return REGISTRY[model]
    path = Path(model)
    if path.exists():
        return path
    looks_like_path = os.sep in str(model) or str(model).startswith(".") or Path(str(model)).suffix
    if looks_like_path:
        raise InvalidArgumentError(f"{model}: no such file or directory")
    raise InvalidArgumentError(f"unknown model {str(model)!r}; known models: {', '.join(REGISTRY)} "
                               f"(or pass a path to a checkpoint directory or file)")


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Config, tensors (memory-mapped, checked for names and shapes) and tokenizer of a checkpoint."""
    path = Path(path)
    if path.is_dir():
        cfg, tensors = read_hf_dir(path)
        tok_path = path / "tokenizer.model"
        tokenizer = Tokenizer(tok_path) if tok_path.is_file() else None
        return Checkpoint(cfg, tensors, tokenizer, path=path)
    if path.suffix in (".safetensors", ".json"):
        raise CheckpointError(f"{path}: pass the directory holding config.json and the safetensors file(s)")
    # llama2.c files have no fixed suffix: the header decides
    cfg, tensors = read_llama2c(path)
    return Checkpoint(cfg, tensors, None, interleaved_rotary=True, path=path)


def path_warning(cfg: ModelConfig, attention: str | None) -> str | None:
    """A one-line warning when `attention` is a path the weights were not trained for, else None.

    Running linear attention on a softmax-trained checkpoint is allowed (it is the comparison
    people make); the caller prints this line.
    """
    path = attention or cfg.attention
    if path in cfg.trained_for:
        return None
    return (f"warning: these weights were trained for {' and '.join(cfg.trained_for)} attention, "
            f"not {path}; expect degraded output")
