"""Build the runtime model from a checkpoint on disk (`models.registry`) on a device, in a dtype.

`build` maps Hugging Face-named tensors onto the runtime model (`models.weights.hf_to_runtime`),
copying only what it must fuse or convert; the rest stay views of the file's memory map. A matrix
whose parts a GGUF file stores as Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks
becomes a QuantLinear on those very blocks (`quantized_matrices`: q/k rows permuted and parts fused by
whole rows of blocks, never decoded; parts of different kinds, as Q4_K_M's, a QuantStack), as
llama.cpp runs them; float GGUF tensors are read as floats. Fused parts are
copies, so the file pages they were read from are dropped (`release`): RSS holds each matrix once;
parts the file stores back to back in order (llama.cpp writes ffn_gate then ffn_up) are one view of
the map instead (`blocks_span`), no copy.
A token embedding stored as blocks stays those blocks (`quantized_embedding`: a lookup decodes the
rows it reads, in `dtype`); a tied lm_head reads the same blocks for its dot products.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from engine.adapters import merge
from engine.attention.feature_maps import Hedgehog
from engine.quant import QuantEmbedding, QuantLinear, QuantStack
from engine.runspec import DTYPES, RunSpec, map_set_for, parse_device, parse_dtype  # noqa: F401
from engine.transformer import Transformer
from models.config import ModelConfig
from models.linearized import read_set
from models.registry import read_checkpoint, resolve
from models.weights import FUSED, hf_shapes, hf_to_runtime, interleaved_to_half

def load_model(model: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, kv_dtype: str | torch.dtype | None = None,
               configure: Callable[[ModelConfig], ModelConfig] | None = None,
               spec: RunSpec | Callable[[ModelConfig], RunSpec] | None = None):
    """Load weights (+ tokenizer when one ships) for a run. Returns (Transformer, tokenizer or None).

    spec: the run (engine.runspec.RunSpec), or a function of the checkpoint's config that resolves
    it (`lambda cfg: RunSpec.resolve(cfg, attention="linear")`); it picks the device, dtype, KV
    dtype and which of a linearized directory's sets of maps loads (`RunSpec.map_set`), and the
    model keeps it as its default run (`Transformer.spec`). The model's config stays the
    checkpoint's. Without a spec: device, dtype (default fp32) and kv_dtype as given, and
    configure (the checkpoint's config -> the config whose mode the run takes, the older form of
    `spec`) or the checkpoint's own mode.
    """
    net, tokenizer, *_ = load_parts(model, device, dtype, kv_dtype, configure, spec)
    return net, tokenizer


def maps_variant(cfg: ModelConfig) -> str | None:
    """Which set of learned maps a run's config asks for (RunSpec.map_set, `engine.runspec.map_set_for`)."""
    return map_set_for(cfg.attention, cfg.window)


def load_parts(model: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, kv_dtype: str | torch.dtype | None = None,
               configure: Callable[[ModelConfig], ModelConfig] | None = None,
               spec: RunSpec | Callable[[ModelConfig], RunSpec] | None = None):
    """`load_model` plus the checkpoint's chat template, the sampling defaults it names and the sets of
    learned maps it ships besides its default (RunSpec.map_set names):
    (Transformer, tokenizer or None, template or None, dict: models.generation_config, tuple)."""
    path = resolve(model)
    if spec is None:
        dtype, kv_dtype, device = parse_dtype(dtype) or torch.float32, parse_dtype(kv_dtype), parse_device(device)
    ckpt = read_checkpoint(path)
    if callable(spec):
        spec = spec(ckpt.config)
    elif spec is None:
        spec = RunSpec.from_config(configure(ckpt.config) if configure is not None else ckpt.config,
                                   dtype=dtype, kv_dtype=kv_dtype, device=device)
    maps, adapters = ckpt.maps, ckpt.adapters
    if spec.map_set in ckpt.variants:     # the set trained for this kind of run
        maps, adapters = read_set(ckpt.variants[spec.map_set], ckpt.config)
    net = build(ckpt.config, ckpt.tensors, spec.device, spec.dtype, interleaved_rotary=ckpt.interleaved_rotary,
                maps=maps, adapters=adapters, adapters_into_base=ckpt.adapters_on == "all", spec=spec)
    return net, ckpt.tokenizer, ckpt.chat_template, ckpt.sampling, tuple(ckpt.variants)


def build(cfg: ModelConfig, hf_tensors, device, dtype, interleaved_rotary: bool = False,
          maps: dict | None = None, adapters: dict | None = None, adapters_into_base: bool = False,
          spec: RunSpec | None = None) -> Transformer:
    """Instantiate the runtime model from Hugging Face-named tensors, without a random init.

    interleaved_rotary: q/k rows in Meta's layout (llama2.c); permuted once, while fusing.
    maps: learned feature maps under runtime names (`models.linearized`); a config naming the
    hedgehog map without them gets fresh (identity) maps.
    adapters: low-rank adapters of the linear layers (`engine.adapters`), merged into the layers'
    adapted projections (adapters_into_base: into their own projections, a softmax control's).
    spec: the run the model is built for (its default run, `Transformer.spec`; None: its config's).
    """
    with torch.device("meta"):
        model = Transformer(cfg, spec)
        if maps is not None and model.hedgehog is not None:
            model.hedgehog.add_parts_of(maps)
    quantized = quantized_matrices(hf_tensors, cfg, device, interleaved_rotary)
    embedding = quantized_embedding(hf_tensors, cfg, device, dtype, quantized.get("lm_head"))
    if embedding is not None:
        quantized["embed_tokens"] = embedding
    runtime = hf_to_runtime(hf_tensors, cfg, device, dtype, interleaved_rotary=interleaved_rotary,
                            skip={f"{path}.weight" for path in quantized})
    tied = cfg.tie_word_embeddings and "lm_head" not in quantized
    if tied:
        runtime["lm_head.weight"] = runtime["embed_tokens.weight"]
    for path, module in quantized.items():
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, module)
        runtime[f"{path}.blocks"] = module.blocks
    if cfg.feature_map == "hedgehog":
        if not maps:   # fresh (identity) maps
            maps = {f"hedgehog.{k}": v for k, v in Hedgehog.for_config(cfg).state_dict().items()}
        runtime.update({k: v.to(device, dtype) for k, v in maps.items()})
    model.load_state_dict(runtime, assign=True, strict=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    if adapters is not None:
        merge(model, adapters, into_base=adapters_into_base)
    return model.eval()


def quantized_embedding(hf_tensors, cfg: ModelConfig, device, dtype, head: QuantLinear | None) -> QuantEmbedding | None:
    """The token embedding on the checkpoint's own blocks (GGUF: any kind `hf_tensors.blocks` hands
    up), looked up in `dtype` a row at a time; a tied lm_head's very blocks tensor (`head`). None
    where the checkpoint holds it otherwise (floats)."""
    blocks_of = getattr(hf_tensors, "blocks", None)
    found = blocks_of("model.embed_tokens.weight") if blocks_of is not None else None
    if found is None:
        return None
    blocks, kind = found
    if cfg.tie_word_embeddings and head is not None and type(head) is QuantLinear:
        blocks = head.blocks   # the same bytes for both
    return QuantEmbedding(blocks.to(device), kind, cfg.vocab_size, cfg.hidden_size, dtype)


def fused_rows(names: list[str], parts: list[torch.Tensor], heads: dict) -> torch.Tensor:
    """Blocks of `parts` (rows, row bytes each) one after another in one new tensor, the rows of a part
    whose name `heads` lists permuted from the interleaved rotary layout on the way (`interleaved_to_half`):
    no temporary copy per part."""
    out = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8)
    at = 0
    for n, b in zip(names, parts):
        dst = out[at:at + b.numel()].view(b.shape)
        h = heads.get(n.split(".", 3)[-1])
        if h is None:
            dst.copy_(b)
        else:
            dst.view(h, 2, b.shape[0] // h // 2, b.shape[1]).copy_(interleaved_to_half(b, h))
        at += b.numel()
    return out


def quantized_matrices(hf_tensors, cfg: ModelConfig, device, interleaved_rotary: bool) -> dict[str, QuantLinear]:
    """Runtime matrices (path -> QuantLinear) whose every part the checkpoint holds as blocks of one
    kind (`hf_tensors.blocks(name)`: GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K), on those blocks
    undecoded: q/k rows permuted from the interleaved rotary layout and q/k/v, gate/up concatenated
    by rows (a row of blocks is a row of weights); parts of different kinds (Q4_K_M's v in Q6_K next
    to q/k in Q4_K, or Q8_0 next to Q5_0) a QuantStack of them. lm_head of tied embeddings reads the embedding's blocks."""
    blocks_of = getattr(hf_tensors, "blocks", None)
    if blocks_of is None:
        return {}
    heads = {"self_attn.q_proj.weight": cfg.num_attention_heads,
             "self_attn.k_proj.weight": cfg.num_key_value_heads} if interleaved_rotary else {}
    groups = {"lm_head": ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        for fused, parts in FUSED.items():
            groups[f"layers.{i}.{fused.removesuffix('.weight')}"] = [f"model.layers.{i}.{p}" for p in parts]
        for plain in ("self_attn.o_proj", "mlp.down_proj"):
            groups[f"layers.{i}.{plain}"] = [f"model.layers.{i}.{plain}.weight"]
    shapes = hf_shapes(cfg)
    release, span_of = getattr(hf_tensors, "release", None), getattr(hf_tensors, "blocks_span", None)
    out = {}
    for path, names in groups.items():
        parts = [blocks_of(n) for n in names]
        if any(p is None for p in parts):
            continue   # a part stored as floats: the whole matrix is read as floats (blocks dequantized)
        out_features = sum(shapes[n][0] for n in names)
        bias = None   # Qwen2's q/k/v biases stay floats: a placeholder here, filled by build's load_state_dict
        if cfg.qkv_bias and path.endswith(".self_attn.qkv"):
            bias = torch.empty(out_features, device="meta")
        segments = []   # (kind, rows): consecutive parts of one kind are one segment
        for n, (_, kind) in zip(names, parts):
            if segments and segments[-1][0] == kind:
                segments[-1] = (kind, segments[-1][1] + shapes[n][0])
            else:
                segments.append((kind, shapes[n][0]))
        # parts stored back to back (gate then up) and not permuted: one view of the map, no copy
        span = span_of(names) if span_of is not None and len(names) > 1 and not any(
            n.split(".", 3)[-1] in heads for n in names) else None
        if span is not None:
            flat = span
        elif len(parts) == 1 and names[0].split(".", 3)[-1] not in heads:
            flat = parts[0][0]
        else:   # fused (and q/k rows permuted) straight into one new tensor, no temporaries
            flat = fused_rows(names, [b for b, _ in parts], heads)
        if len(segments) == 1:
            out[path] = QuantLinear(flat.view(out_features, -1).to(device), segments[0][0], shapes[names[0]][1],
                                    out_features, bias=bias, own=flat is not span and flat is not parts[0][0])
        else:
            out[path] = QuantStack(flat.reshape(-1).to(device), segments, shapes[names[0]][1], bias=bias)
        if len(names) > 1 and span is None and release is not None:
            for n in names:   # fused: the copy is what the model holds; the file's pages it read can go
                release(n)
    return out
