"""Shared fixtures: small random models on the CPU, and the location of ../shared."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("GEN_SHARED_DIR", ROOT.parent / "shared"))


def tiny_config(**overrides) -> ModelConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=97, max_position_embeddings=128, rms_norm_eps=1e-5)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, dtype=torch.float32, **overrides) -> Transformer:
    """A random model whose weights are big enough that attention is far from uniform."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    return model.to(dtype).eval()


def shared_path(*parts: str) -> Path:
    """A file under ../shared, or skip the test with the reason."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found: ../shared is absent on this machine")
    return path
