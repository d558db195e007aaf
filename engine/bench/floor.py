"""The memory-bandwidth floor of a decode step: the least time a step can take if it only had to
stream the bytes it must read once, at the device's measured copy bandwidth.

    bw = copy_bandwidth(device)                  # bytes read + written per second, measured once per run
    floor_ms = (weight_bytes_read(model, state) + state bytes read at the depth) / bw * 1e3

Weights read per step: every matrix the step streams for one token in its stored form (quantized
blocks, 16-bit or fp32), norms, one embedding row per sequence, and the learned feature maps of a
linear layer; once per step whatever the batch. State read: the KV cache up to the depth (every
sequence of the batch), or the linear state (S and z), or both, per layer.

Copy bandwidth: the best of `copies` copies of one buffer into another on the device (CUDA: 1 GiB,
timed with the device synchronised; CPU: 256 MiB, far beyond any cache, on the bench's threads, as
benchmarks/bandwidth_floor.py measures it), counted as bytes read + written per second (the STREAM
convention). A step that only reads could go a little faster than this floor on some devices.
"""
from __future__ import annotations

import time

import torch

from engine.quant import QuantEmbedding, QuantLinear

BUFFER_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}


def copy_bandwidth(device: torch.device | str, copies: int = 5) -> dict:
    """{"bytes_per_s", "buffer_bytes", "copies", "method"}: the best of `copies` device-to-device copies."""
    device = torch.device(device)
    n = BUFFER_BYTES.get(device.type, BUFFER_BYTES["cpu"])
    a = torch.ones(n, dtype=torch.uint8, device=device)
    b = torch.zeros_like(a)   # touched: no first-use cost in the timing
    b.copy_(a)                # warm-up
    best = float("inf")
    for _ in range(copies):
        _sync(device)
        t = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    del a, b
    return {"bytes_per_s": 2 * n / best, "buffer_bytes": n, "copies": copies,
            "method": f"best of {copies} copies of {n >> 20} MiB on {device}, bytes read + written per second"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(module) -> int:
    if isinstance(module, QuantLinear):
        return module.blocks.numel() * module.blocks.element_size()
    return module.weight.numel() * module.weight.element_size()


def weight_bytes_read(model, state) -> int:
    """What one decode step on `state` streams of the weights: each layer's projections as `state` runs
    it (a linear layer reads its adapted copies where it has them), the MLP, norms, lm_head, one
    embedding row per sequence, and the learned maps when a layer runs linear."""
    paths = model.paths_of(state)
    total = _nbytes(model.lm_head) + model.norm.weight.numel() * model.norm.weight.element_size()
    for layer, path in zip(model.layers, paths):
        total += sum(_nbytes(m) for m in (*layer.self_attn.projections(path != "softmax"), layer.mlp.gate_up,
                                          layer.mlp.down_proj))
        total += 2 * layer.input_layernorm.weight.numel() * layer.input_layernorm.weight.element_size()
    if "linear" in paths and model.hedgehog is not None:
        total += sum(p.numel() * p.element_size() for p in model.hedgehog.parameters())
    emb = model.embed_tokens
    row = (emb.blocks.numel() // emb.num_embeddings if isinstance(emb, QuantEmbedding)   # one row of blocks
           else emb.weight.shape[1] * emb.weight.element_size())
    return total + state.batch_size * row


def floor_ms(record: dict, bytes_per_s: float) -> float | None:
    """A bench record's floor in ms per step (None for a record without the bytes it read)."""
    if record.get("weight_bytes_read") is None or record.get("state_bytes_read") is None:
        return None
    return (record["weight_bytes_read"] + record["state_bytes_read"]) / bytes_per_s * 1e3


__all__ = ["copy_bandwidth", "weight_bytes_read", "floor_ms", "BUFFER_BYTES"]
