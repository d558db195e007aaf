"""Write a random checkpoint of a real model's shape (config.json + model.safetensors), for machines
that cannot reach a model hub (the GPU runs of issue 35): decode speed depends on the shapes and the
weight type, not on the values.

    python benchmarks/random_checkpoint.py OUT_DIR [--shape llama-3.2-1b] [--dtype bfloat16] [--device cuda]

Shapes: `llama-3.2-1b` (1.24B parameters: 16 layers, hidden 2048, 32/8 heads of 64, MLP 8192, vocab
128,256, tied embeddings, RoPE theta 500,000 with Llama 3's scaling), `smollm2-135m`, `tiny-test`
(a few MB, for checking this script). Weights ~ N(0, 0.02), norms 1. The file is written tensor by
tensor from `--device` (random numbers are drawn there: fast on a GPU). It reads the shapes a config
implies from models (ModelConfig, `hf_shapes`): a checkpoint is written here, never loaded.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.config import ModelConfig
from models.weights import hf_shapes

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         bos_token_id=128000, eos_token_id=128001),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
    "tiny-test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2),
}


def write(out: Path, shape: str, dtype: torch.dtype, device: str, seed: int = 0) -> int:
    """Write the checkpoint; returns its parameter count."""
    raw = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               torch_dtype=str(dtype).removeprefix("torch."))
    cfg = ModelConfig.from_dict(raw)          # the engine's own reading of it: a shape it refuses fails here
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors, count = {}, 0
    for name, dims in hf_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=dtype, device=device)
        else:
            t = (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
        tensors[name] = t.cpu()
        count += t.numel()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("random_checkpoint: --device cuda but no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    n = write(a.out, a.shape, getattr(torch, a.dtype), a.device, a.seed)
    print(f"{a.out}: {a.shape}, {n / 1e9:.3f}B parameters, {a.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
