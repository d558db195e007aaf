"""Find and load a model: a registered name (`tiny`) or a path to a checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.errors import CheckpointError, InvalidArgumentError
from models.config import ModelConfig
from models.tokenizer import Tokenizer
from models.transformer import Transformer
from models.weights import check_tensors, hf_to_runtime

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
    """Load weights (+ tokenizer when one ships) onto `device` in `dtype` (default: fp32)."""
    path = resolve(model)
    dtype = parse_dtype(dtype) or torch.float32
    if path.is_dir():
        cfg, tensors = _read_hf_dir(path)
        tok_path = path / "tokenizer.model"
        tokenizer = Tokenizer(tok_path) if tok_path.is_file() else None
    else:
        raise CheckpointError(f"{path}: unrecognised checkpoint file; pass a Hugging Face layout directory")
    return build(cfg, tensors, device, dtype), tokenizer


def build(cfg: ModelConfig, hf_tensors, device, dtype) -> Transformer:
    """Instantiate the runtime model from Hugging Face-named tensors, without a random init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    runtime = {k: v.to(device=device, dtype=dtype) for k, v in hf_to_runtime(hf_tensors, cfg).items()}
    if cfg.tie_word_embeddings:
        runtime["lm_head.weight"] = runtime["embed_tokens.weight"]
    model.load_state_dict(runtime, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def _read_hf_dir(path: Path):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    cfg = ModelConfig.from_json(path / "config.json")
    st = path / "model.safetensors"
    if not st.is_file():
        raise CheckpointError(f"{path}: no model.safetensors")
    try:
        tensors = load_file(st)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{st}: cannot read safetensors ({str(e).splitlines()[0]})") from None
    check_tensors(tensors, cfg, str(st))
    return cfg, tensors
