"""Checkpoint names <-> runtime names, in one place; save and load Hugging Face layout dirs.

Hugging Face Llama names                      runtime (models.transformer)
model.embed_tokens.weight                     embed_tokens.weight
model.layers.N.input_layernorm.weight         layers.N.input_layernorm.weight
model.layers.N.self_attn.{q,k,v}_proj.weight  layers.N.self_attn.qkv.weight   (rows concatenated)
model.layers.N.self_attn.o_proj.weight        layers.N.self_attn.o_proj.weight
model.layers.N.post_attention_layernorm.weight layers.N.post_attention_layernorm.weight
model.layers.N.mlp.{gate,up}_proj.weight      layers.N.mlp.gate_up.weight     (rows concatenated)
model.layers.N.mlp.down_proj.weight           layers.N.mlp.down_proj.weight
model.norm.weight                             norm.weight
lm_head.weight (absent when tied)             lm_head.weight
"""
from __future__ import annotations

import os

import torch

from engine.errors import CheckpointError
from models.config import ModelConfig

FUSED = {  # runtime suffix -> checkpoint suffixes, concatenated along rows
    "self_attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
PLAIN = ("input_layernorm.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
         "mlp.down_proj.weight")


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Llama checkpoint of `cfg` holds, with its shape."""
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, C), "model.norm.weight": (C,)}
    per_layer = {
        "input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
        "self_attn.q_proj.weight": (H * D, C), "self_attn.k_proj.weight": (Hkv * D, C),
        "self_attn.v_proj.weight": (Hkv * D, C), "self_attn.o_proj.weight": (C, H * D),
        "mlp.gate_proj.weight": (I, C), "mlp.up_proj.weight": (I, C), "mlp.down_proj.weight": (C, I),
    }
    for i in range(cfg.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, C)
    return shapes


def check_tensors(tensors, cfg: ModelConfig, where: str) -> None:
    """Every expected tensor present with its expected shape, or a CheckpointError naming it."""
    for name, shape in hf_shapes(cfg).items():
        if name not in tensors:
            raise CheckpointError(f"{where}: missing tensor {name}")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(found)}, expected {list(shape)}")


def hf_to_runtime(tensors, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face names to runtime names (fusing q/k/v and gate/up)."""
    out = {"embed_tokens.weight": tensors["model.embed_tokens.weight"],
           "norm.weight": tensors["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for name in PLAIN:
            out[dst + name] = tensors[src + name]
        for fused, parts in FUSED.items():
            out[dst + fused] = torch.cat([tensors[src + p] for p in parts], dim=0)
    return out


def runtime_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_runtime`: split the fused matrices back into q/k/v and gate/up."""
    D, H, Hkv, I = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    split = {"self_attn.qkv.weight": [H * D, Hkv * D, Hkv * D], "mlp.gate_up.weight": [I, I]}
    out = {"model.embed_tokens.weight": state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        for name in PLAIN:
            out[dst + name] = state[src + name]
        for fused, parts in FUSED.items():
            for part, t in zip(parts, state[src + fused].split(split[fused], dim=0)):
                out[dst + part] = t
    return out


def save_pretrained(model, out_dir: str, dtype: torch.dtype | None = None,
                    tokenizer_path: str | None = None) -> None:
    """Write config.json + model.safetensors (+ tokenizer.model) in the Hugging Face layout."""
    import shutil

    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config
    dtype = dtype or model.dtype
    tensors = {k: v.detach().to("cpu", dtype).contiguous()
               for k, v in runtime_to_hf(model.state_dict(), cfg).items()}
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    cfg.replace(torch_dtype=str(dtype).removeprefix("torch.")).to_json(os.path.join(out_dir, "config.json"))
    if tokenizer_path and os.path.abspath(tokenizer_path) != os.path.abspath(os.path.join(out_dir, "tokenizer.model")):
        shutil.copyfile(tokenizer_path, os.path.join(out_dir, "tokenizer.model"))
