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
Qwen2 (cfg.qkv_bias):
model.layers.N.self_attn.{q,k,v}_proj.bias    layers.N.self_attn.qkv.bias     (concatenated)
Qwen3 (cfg.qk_norm):
model.layers.N.self_attn.{q,k}_norm.weight    layers.N.self_attn.{q,k}_norm.weight   (head_dim each)

llama2.c files hold the same tensors under Meta's names in a fixed order (`llama2c_layout`), with
the q and k rows of each head in Meta's interleaved rotary layout (pairs 2i, 2i+1) where Hugging
Face and the runtime use half-split pairs (i, i + D/2): `interleaved_to_half` permutes them, once,
while loading or converting.
"""
from __future__ import annotations

import os
import stat

import torch

from models.errors import CheckpointError
from models.config import ModelConfig
from models.replace import replacing

FUSED = {  # runtime suffix -> checkpoint suffixes, concatenated along rows
    "self_attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
PLAIN = ("input_layernorm.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
         "mlp.down_proj.weight")
QKV_BIAS = ("self_attn.qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"))
QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def fused_of(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """FUSED, plus Qwen2's q/k/v biases (one bias of the fused qkv)."""
    return {**FUSED, QKV_BIAS[0]: QKV_BIAS[1]} if cfg.qkv_bias else FUSED


def plain_of(cfg: ModelConfig) -> tuple[str, ...]:
    """PLAIN, plus Qwen3's per-head q/k norms."""
    return PLAIN + QK_NORM if cfg.qk_norm else PLAIN


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `cfg` (Llama, Mistral, Qwen2, Qwen3) holds, with its shape."""
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, C), "model.norm.weight": (C,)}
    per_layer = {
        "input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
        "self_attn.q_proj.weight": (H * D, C), "self_attn.k_proj.weight": (Hkv * D, C),
        "self_attn.v_proj.weight": (Hkv * D, C), "self_attn.o_proj.weight": (C, H * D),
        "mlp.gate_proj.weight": (I, C), "mlp.up_proj.weight": (I, C), "mlp.down_proj.weight": (C, I),
    }
    if cfg.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (H * D,), "self_attn.k_proj.bias": (Hkv * D,),
                          "self_attn.v_proj.bias": (Hkv * D,)})
    if cfg.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)})
    for i in range(cfg.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, C)
    return shapes


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)   # what a weight may be stored as


def check_tensors(tensors, cfg: ModelConfig, where: str) -> None:
    """Every expected tensor present with its expected shape and a float dtype, or a CheckpointError naming it."""
    for name, shape in hf_shapes(cfg).items():
        if name not in tensors:
            raise CheckpointError(f"{where}: missing tensor {name}")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(found)}, expected {list(shape)}")
        dtype = tensors[name].dtype
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: tensor {name} is stored as {str(dtype).removeprefix('torch.')}, "
                                  f"which a weight cannot be; accepted: float32, float16, bfloat16, float64")


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k rows (n_heads*D, C) from Meta's interleaved rotary pairs to Hugging Face's half-split.

    Returns a view (n_heads, 2, D/2, C); `.reshape(w.shape)` materialises it, or copy it
    straight into a destination viewed the same way (one copy, see `hf_to_runtime`).
    """
    rows, C = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, C).transpose(1, 2)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `interleaved_to_half`, as a (rows, C) tensor."""
    rows, C = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, C).transpose(1, 2).reshape(rows, C)


def _fuse(parts, device, dtype) -> torch.Tensor:
    """Write each part straight into its rows of one new matrix (the single copy of the load).

    parts: (rows_i, C) tensors, or the (H, 2, D/2, C) views of `interleaved_to_half`; dtype and
    device conversion happen in the same copy. 1-D parts (biases) are concatenated.
    """
    if parts[0].dim() == 1:
        return torch.cat([p.to(device=device, dtype=dtype) for p in parts])
    rows = sum(p.numel() // p.shape[-1] for p in parts)
    out = torch.empty(rows, parts[0].shape[-1], device=device, dtype=dtype)
    start = 0
    for p in parts:
        n = p.numel() // p.shape[-1]
        out[start:start + n].view(p.shape).copy_(p)
        start += n
    return out


def hf_to_runtime(tensors, cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.float32,
                  interleaved_rotary: bool = False, skip=frozenset()) -> dict[str, torch.Tensor]:
    """Map Hugging Face names to runtime names on `device` in `dtype`.

    q/k/v and gate/up are fused, which copies them once; every other tensor is passed through
    `.to()`, which returns the (memory-mapped) tensor itself when device and dtype already match.
    interleaved_rotary: q/k rows are in Meta's layout (llama2.c) and are permuted during the fuse.
    skip: runtime names not to build (matrices the caller builds from quantized blocks itself).
    """
    out = {"norm.weight": tensors["model.norm.weight"]}
    if "embed_tokens.weight" not in skip:
        out["embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    if not cfg.tie_word_embeddings and "lm_head.weight" not in skip:
        out["lm_head.weight"] = tensors["lm_head.weight"]
    rotary_heads = {"self_attn.q_proj.weight": cfg.num_attention_heads,
                    "self_attn.k_proj.weight": cfg.num_key_value_heads} if interleaved_rotary else {}
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for name in plain_of(cfg):
            if dst + name not in skip:
                out[dst + name] = tensors[src + name]
        for fused, parts in fused_of(cfg).items():
            if dst + fused in skip:
                continue
            ts = [interleaved_to_half(tensors[src + p], rotary_heads[p]) if p in rotary_heads
                  else tensors[src + p] for p in parts]
            out[dst + fused] = _fuse(ts, device, dtype)
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def runtime_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_runtime`: split the fused matrices back into q/k/v and gate/up."""
    D, H, Hkv, I = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    split = {"self_attn.qkv.weight": [H * D, Hkv * D, Hkv * D], "mlp.gate_up.weight": [I, I],
             QKV_BIAS[0]: [H * D, Hkv * D, Hkv * D]}
    out = {"model.embed_tokens.weight": state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        for name in plain_of(cfg):
            out[dst + name] = state[src + name]
        for fused, parts in fused_of(cfg).items():
            for part, t in zip(parts, state[src + fused].split(split[fused], dim=0)):
                out[dst + part] = t
    return out


def save_safetensors(tensors: dict, file: str | os.PathLike, metadata: dict | None = None,
                     private: bool = False) -> None:
    """Write a safetensors file whole (models.replace: a temporary file beside it, renamed; a failed write
    leaves neither a half-written FILE nor the temporary; a symbolic link is followed and stays a link).
    Readable as an existing FILE was, else as the process's umask allows, like any file it writes
    (safetensors' writer makes its files 0600 whatever the umask, so a model directory copied to a
    shared place was unreadable to everyone but its writer); `private`: 0600 (a saved conversation).
    A directory, device or FIFO at FILE, or a path that cannot be written, is CheckpointError."""
    from safetensors.torch import save_file
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:   # a loop of links, a directory that cannot be searched
        raise CheckpointError(f"cannot write {os.fspath(file)}: {e.strerror or e}") from None
    if mode is not None and not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise CheckpointError(f"{os.fspath(file)}: is {what}; give a file path to write")
    try:
        with replacing(file, private=private) as tmp:
            save_file(tensors, tmp, metadata=metadata)
    except OSError as e:   # the temporary's name would only confuse
        raise CheckpointError(f"cannot write {os.fspath(file)}: {e.strerror or e}") from None


def save_pretrained(model, out_dir: str, dtype: torch.dtype | None = None,
                    tokenizer_path: str | None = None) -> None:
    """Write config.json + model.safetensors (+ tokenizer.model) in the Hugging Face layout."""
    import shutil
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config
    dtype = dtype or model.dtype
    tensors = {k: v.detach().to("cpu", dtype).contiguous()
               for k, v in runtime_to_hf(model.state_dict(), cfg).items()}
    save_safetensors(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg.replace(torch_dtype=str(dtype).removeprefix("torch.")).to_json(os.path.join(out_dir, "config.json"))
    if tokenizer_path and os.path.abspath(tokenizer_path) != os.path.abspath(os.path.join(out_dir, "tokenizer.model")):
        shutil.copyfile(tokenizer_path, os.path.join(out_dir, "tokenizer.model"))


# llama2.c (Meta) name -> Hugging Face per-layer suffix
LLAMA2C_LAYER = {"attention_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
                 "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
                 "wo": "self_attn.o_proj.weight", "ffn_norm": "post_attention_layernorm.weight",
                 "w1": "mlp.gate_proj.weight", "w2": "mlp.down_proj.weight", "w3": "mlp.up_proj.weight"}
LLAMA2C_ORDER = {  # per-layer tensors are stored stacked: every layer's wq, then every layer's wk, ...
    0: ("tok_embeddings", "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3", "norm",
        "freqs_cos", "freqs_sin", "output"),
    1: ("attention_norm", "ffn_norm", "norm", "tok_embeddings", "wq", "wk", "wv", "wo", "w1", "w2", "w3",
        "output"),
}


def llama2c_layout(cfg: ModelConfig, version: int) -> list[tuple[str | None, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every float32 tensor of a llama2.c file, in file order.

    The name is None for the legacy format's unused RoPE tables (seq_len x D/2 each, skipped);
    `output` (lm_head) is present only when the classifier is not shared (tie_word_embeddings False).
    """
    shapes = hf_shapes(cfg)
    top = {"tok_embeddings": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight"}
    rope_table = (cfg.max_position_embeddings, cfg.head_dim // 2)
    layout = []
    for meta in LLAMA2C_ORDER[version]:
        if meta in LLAMA2C_LAYER:
            names = [f"model.layers.{i}.{LLAMA2C_LAYER[meta]}" for i in range(cfg.num_hidden_layers)]
            layout += [(n, shapes[n]) for n in names]
        elif meta in ("freqs_cos", "freqs_sin"):
            layout.append((None, rope_table))
        elif top[meta] in shapes:   # lm_head only when untied
            layout.append((top[meta], shapes[top[meta]]))
    return layout


def hf_to_llama2c(tensors, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors with q/k rows permuted back to Meta's interleaved rotary layout."""
    out = dict(tensors)
    for i in range(cfg.num_hidden_layers):
        for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            out[name] = half_to_interleaved(tensors[name], heads)
    return out
