"""Find and load a model: a registered name (`tiny`) or a path to a checkpoint.

A path is a Hugging Face layout directory (`models.hf_dir`) or a llama2.c file (`models.llama2c`).
Both readers hand back memory-mapped tensors under Hugging Face names; `build` maps them onto
the runtime model (`models.weights.hf_to_runtime`), copying only what it must fuse or convert.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.errors import CheckpointError, InvalidArgumentError
from models.config import ModelConfig
from models.hf_dir import read_hf_dir
from models.llama2c import read_llama2c
from models.tokenizer import Tokenizer
from models.transformer import Transformer
from models.weights import hf_to_runtime

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
REGISTRY = {"tiny": WEIGHTS_DIR / "tiny"}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {name!r}; valid: float32, float16, bfloat16") from None


def parse_device(device: str | torch.device) -> torch.device:
    """A torch device this machine has; otherwise an InvalidArgumentError saying what it has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {device!r} asked for, but this torch build or machine has no CUDA; "
                                   f"use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidArgumentError(f"device {device!r} does not exist; this machine has "
                                   f"{torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda", "mps", "xpu"):
        raise InvalidArgumentError(f"unsupported device {device!r}; use cpu or cuda")
    return dev


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


def load_model(model: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None) -> tuple[Transformer, Tokenizer | None]:
    """Load weights (+ tokenizer when one ships) onto `device` in `dtype` (default: fp32).

    The model computes in `dtype` whatever dtype the checkpoint stores.
    """
    path = resolve(model)
    dtype = parse_dtype(dtype) or torch.float32
    device = parse_device(device)
    tokenizer, interleaved = None, False
    if path.is_dir():
        cfg, tensors = read_hf_dir(path)
        tok_path = path / "tokenizer.model"
        tokenizer = Tokenizer(tok_path) if tok_path.is_file() else None
    elif path.suffix in (".safetensors", ".json"):
        raise CheckpointError(f"{path}: pass the directory holding config.json and the safetensors file(s)")
    else:   # llama2.c files have no fixed suffix: the header decides
        cfg, tensors = read_llama2c(path)
        interleaved = True
    return build(cfg, tensors, device, dtype, interleaved_rotary=interleaved), tokenizer


def build(cfg: ModelConfig, hf_tensors, device, dtype, interleaved_rotary: bool = False) -> Transformer:
    """Instantiate the runtime model from Hugging Face-named tensors, without a random init.

    interleaved_rotary: q/k rows in Meta's layout (llama2.c); permuted once, while fusing.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    runtime = hf_to_runtime(hf_tensors, cfg, device, dtype, interleaved_rotary=interleaved_rotary)
    if cfg.tie_word_embeddings:
        runtime["lm_head.weight"] = runtime["embed_tokens.weight"]
    model.load_state_dict(runtime, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


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
