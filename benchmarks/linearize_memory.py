"""Activation memory of `gen linearize`'s finetune for a model shape, counted without the model's memory.

    python benchmarks/linearize_memory.py                      # Llama-3.1-8B's shape, LoRA rank 32, bf16 weights
    python benchmarks/linearize_memory.py --dtype float32 --tokens 2048 --lora-rank 0

The model is built on PyTorch's 'meta' device (shapes, no data), its maps and adapters trainable as
the finetune makes them, and one forward + loss runs under `saved_tensors_hooks`: every tensor
autograd keeps for the backward pass is counted once (views counted as their base; the frozen
weights and trainable parameters themselves are not counted: they are the model's memory, not
activations). One and two layers are counted; their difference is one layer's activations per
token, the rest (embeddings, the final norm, fp32 logits for the loss) is the head. docs/usage.md
("Linearizing on GPUs") uses these figures. The backward pass adds temporaries on top (about one
layer's worth at a time) and the allocator rounds up: measure the real peak with
torch.cuda.max_memory_allocated() on the first steps.

Two shims for the meta device only (no data, so nothing can be read back): rotary positions 0..T-1
come from `Rotary.for_range` instead of a lookup that reads the largest position, and the meta device
counts as not under autocast. It builds the model from its pieces (engine.transformer, engine.adapters)
on purpose: the public API loads real weights, and this counts a model that is never materialized.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import engine.transformer as transformer
from engine.adapters import LoRA, attach
from models.config import ModelConfig

_autocast = torch.is_autocast_enabled
torch.is_autocast_enabled = lambda *a: False if a and a[0] == "meta" else _autocast(*a)
transformer.Rotary.forward = lambda self, positions, dtype: self.for_range(0, positions.shape[1], positions.device,
                                                                           dtype)


def saved_bytes(shape: dict, layers: int, tokens: int, rank: int, dtype: torch.dtype, decay: bool) -> int:
    cfg = ModelConfig(**shape, num_hidden_layers=layers, feature_map="hedgehog", attention="linear")
    with torch.device("meta"):
        model = transformer.Transformer(cfg).to(dtype)
        maps = model.hedgehog.float()          # as gen linearize keeps them
        if decay:
            maps.add_decay()
        for p in model.parameters():
            p.requires_grad_(False)
        for p in maps.parameters():
            p.requires_grad_(True)
        lora = LoRA.for_config(cfg, rank) if rank else None
    if lora is not None:
        attach(model, lora)
    params = {id(p) for p in model.parameters()} | ({id(p) for p in lora.parameters()} if lora else set())
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        base = t._base if t._base is not None else t
        if id(base) not in params and id(base) not in seen:
            seen.add(id(base))
            total += base.numel() * base.element_size()
        return t

    ids = torch.zeros(1, tokens + 1, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids[:, :-1]).float()
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of one row (--seq-len)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--decay", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the frozen weights")
    a = ap.parse_args()
    shape = dict(hidden_size=a.hidden, intermediate_size=a.intermediate, num_attention_heads=a.heads,
                 num_key_value_heads=a.kv_heads, vocab_size=a.vocab, max_position_embeddings=max(8192, a.tokens),
                 rms_norm_eps=1e-5)
    dtype = getattr(torch, a.dtype)
    one, two = (saved_bytes(shape, n, a.tokens, a.lora_rank, dtype, a.decay) for n in (1, 2))
    layer, head = two - one, one - (two - one)
    total = head + a.layers * layer
    print(f"{a.dtype} weights, LoRA rank {a.lora_rank}{', decay' if a.decay else ''}, one row of {a.tokens} tokens: "
          f"{layer / a.tokens / 1e3:.0f} kB a token a layer, head {head / a.tokens / 1e3:.0f} kB a token; "
          f"{a.layers} layers: {total / a.tokens / 1e6:.1f} MB a token, {total / 1e9:.1f} GB a row")


if __name__ == "__main__":
    main()
