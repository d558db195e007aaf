"""Decode ms/step of the linear path with learned maps of the shipped kind (hedgehog feature maps with a
gated decay, as smollm2-linear ships) on any checkpoint, next to softmax and elu1 in the same process: the
maps are random (speed depends on their shapes, not their values). Issue 35's "linear <= softmax with the
shipped hedgehog + gated decay maps" on a model too big to linearize here.

    python benchmarks/gpu_maps.py MODEL_DIR [--device cuda] [--dtype bfloat16] [--batch 1] [--depth 1024]
        [--backend graph] [--steps 64] [--json FILE]

Rows: softmax, linear elu1, linear hedgehog + gated decay with the map inside the fused decode kernel
(what LinearState picks on CUDA), and the same hedgehog map featurized in torch before the fused step
(the route before the map was fused: `engine.attention.linear.why_not_hedgehog` patched to refuse), so
the map's fusion is an A/B in one process. The `map` column says where the map ran: "in kernel" or the
reason it ran in torch (`LinearState.map_in_kernel_why_not`, asked eagerly: under `--backend compiled`
the traced torch form runs whatever it says).

Each configuration: a state of depth + steps + warm-up slots, `--prefill` real tokens prefilled (the KV
cache's remaining depth filled by repeating them, as `gen bench --prefill-tokens` does), then `--warmup`
untimed and `--steps` timed one-token steps through the run's step (`engine.load`, then per
configuration its RunSpec on the path and map, with a fresh step: benchmarks/runs.py), synchronised each
step (median). The random maps are set on the model itself (an internal on purpose).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import engine
from engine.attention import linear as attention_linear
from engine.attention.feature_maps import Hedgehog
from runs import with_run

TORCH_MAP = "hedgehog (map in torch)"   # the A/B row: the torch featurization before the fused step


def with_gated_maps(model, seed: int = 0):
    """Random hedgehog maps with a gated decay on `model` (in place, fp32 like linearized ones)."""
    cfg = model.config
    maps = Hedgehog.for_config(cfg)
    maps.add_gate()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in maps.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.hedgehog = maps.to(model.device)
    return model


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def map_where(state, model) -> str:
    """Where a linear state's decode applies its feature map: "in kernel", or why not."""
    if state.path != "linear":
        return "-"
    cfg = model.config
    q = torch.zeros(state.S.shape[1], cfg.num_attention_heads, 1, cfg.head_dim, device=model.device, dtype=model.dtype)
    kv = torch.zeros(state.S.shape[1], cfg.num_key_value_heads, 1, cfg.head_dim, device=model.device, dtype=model.dtype)
    reason = state.map_in_kernel_why_not(0, q, kv, kv)
    return "in kernel" if reason is None else reason


class MapInTorch:
    """Within it, LinearState featurizes a hedgehog map in torch before the fused step (as before the fusion)."""
    def __enter__(self):
        self.saved = attention_linear.why_not_hedgehog
        attention_linear.why_not_hedgehog = lambda *args: "the A/B row: the map featurized in torch"

    def __exit__(self, *exc):
        attention_linear.why_not_hedgehog = self.saved


@torch.inference_mode()
def time_config(llm, attention, feature_map, a) -> dict:
    if feature_map == TORCH_MAP:
        with MapInTorch():
            return dict(time_config(llm, attention, "hedgehog", a), feature_map=TORCH_MAP)
    model = llm.model
    step = with_run(llm).step                    # a fresh step per configuration
    B, n = a.batch, a.depth + a.warmup + a.steps + 1
    state = model.init_state(B, max_len=n, spec=llm.spec.with_path(model.config, attention, feature_map))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (B, a.prefill), generator=g).to(model.device)
    logits = step(ids, state, last_only=True)
    if attention == "softmax" and a.depth > a.prefill:      # fill the cache to the depth with copies
        for t in (state.k, state.v):
            src = t[:, :, :, :a.prefill]
            for s in range(a.prefill, a.depth, a.prefill):
                e = min(s + a.prefill, a.depth)
                t[:, :, :, s:e] = src[:, :, :, :e - s]
        state.slots, state.lengths[:] = a.depth, a.depth
    tok = logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for i in range(a.warmup + a.steps):
        sync(model.device)
        t0 = time.perf_counter()
        tok = step(tok, state)[:, -1].argmax(-1, keepdim=True)
        sync(model.device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    return {"attention": attention, "feature_map": feature_map, "batch": B, "depth": a.depth,
            "ms_per_step": round(ms, 4), "tokens_per_s": round(B * 1e3 / ms, 1), "state_bytes": state.nbytes,
            "step_form": step.last_form, "fallback": step.fallback, "map": map_where(state, model)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--depth", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--backend", default="graph")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_maps: --device cuda but no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    llm = engine.load(a.model, device=a.device, dtype=a.dtype, backend=a.backend)
    model = with_gated_maps(llm.model)
    rows = [time_config(llm, att, fm, a) for att, fm in
            (("softmax", None), ("linear", "elu1"), ("linear", "hedgehog"), ("linear", TORCH_MAP))]
    name = torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {a.model}, {a.dtype}, backend {a.backend}")
    print("| attention | map | batch | depth | ms/step | tok/s | state bytes | form | map runs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        print(f"| {r['attention']} | {r['feature_map'] or '-'} | {r['batch']} | {r['depth']} | {r['ms_per_step']} | "
              f"{r['tokens_per_s']} | {r['state_bytes']:,} | {r['step_form']} | {r['map']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "args": vars(a), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
