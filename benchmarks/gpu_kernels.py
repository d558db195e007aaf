"""The Triton decode kernels (engine.kernels) against the torch forms they replace, on one CUDA GPU.

    python benchmarks/gpu_kernels.py [--json out.json] [--reps 50] [--shapes 1x1024,1x32768,32x8192,32x32768]

Attention of one decode token for one layer of a Llama-3.2-1B-shaped model: 32 query heads on 8 kv
heads (G 4), head 64, a bfloat16 KV cache and query, an fp32 linear state.
- softmax: `softmax_decode` (split-K flash decoding) vs `scaled_dot_product_attention` (enable_gqa) and
  `one_query_attention` (two matmuls, the eager decode's form), at each (batch, depth); the cache is
  exactly depth slots long. Bandwidth: the K and V bytes read / time.
- linear: `linear_decode_elu1` (elu+1 inside the kernel) vs the torch step LinearState ran before
  (featurize, `linear_attention_step`, cast), and `linear_decode` vs `linear_attention_step` on a
  hedgehog-sized state (F 128) with a gated decay; per batch (the state does not grow with depth).
  Bandwidth: the S and z bytes read / time (the step also writes them back: twice the traffic).
- hedgehog: `linear_decode_hedgehog` (random hedgehog maps with a gated decay applied inside the kernel,
  from bf16 q, k, v) vs LinearState's route before it (the map and its gate in torch, then
  `linear_decode`), and the kernel under other blocks (engine.kernels.linear.HEDGEHOG_TILE, the products
  of its weight tile, and HEDGEHOG_WARPS: "tile x warps" rows) to check the defaults on a real GPU.
Time: the median of --reps calls, each timed alone with CUDA events after a 256 MiB write that
evicts the L2 cache (so a small state is read from memory, as in a real step, not from L2).
Exits 2 without CUDA. The kernels are internals on purpose (engine.kernels, engine.attention): this
times them alone, not a step.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from engine.attention.feature_maps import Elu1, Hedgehog
from engine.attention.linear import hedgehog_layer
from engine.attention.softmax import one_query_attention
from engine.kernels import (linear_attention_step, linear_decode, linear_decode_elu1, linear_decode_hedgehog,
                            softmax_decode, why_not)
from engine.kernels import linear as linear_kernels

HKV, G, D = 8, 4, 64


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this file as JSON")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per cell (the median is reported)")
    ap.add_argument("--shapes", default="1x1024,1x32768,32x8192,32x32768",
                    help="BATCHxDEPTH, comma-separated (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        args.shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        assert all(len(s) == 2 and min(s) > 0 for s in args.shapes)
    except (ValueError, AssertionError):
        ap.error(f"--shapes: BATCHxDEPTH pairs such as 1x1024,32x8192, not {args.shapes!r}")
    return args


class Timer:
    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        """Median ms of one call of fn, L2 evicted before each."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def softmax_rows(timer, B, N):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HKV * G, 1, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, HKV, N, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, HKV, N, D, device="cuda", generator=g).bfloat16()
    n_keys = torch.full((B,), N, device="cuda", dtype=torch.long)
    scale = torch.tensor(D ** -0.5, device="cuda")
    nbytes = k.numel() * k.element_size() * 2
    forms = {"softmax_decode": lambda: softmax_decode(q, k, v, n_keys, None, scale),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
             "one_query_attention": lambda: one_query_attention(q, k, v, scale)}
    rows = []
    for name, fn in forms.items():
        ms = timer(fn)
        rows.append({"op": "softmax", "form": name, "batch": B, "depth": N, "ms": ms, "bytes": nbytes,
                     "GB/s": nbytes / ms / 1e6})
    del k, v
    return rows


def elu1_torch_step(q, k, v, S, z):
    """LinearState's decode step before the kernel (elu1: no decay)."""
    fm = Elu1()
    B, H = q.shape[:2]
    phi_k = fm(k)
    phi_q = fm(q).view(B, HKV, G, 1, D)
    out = linear_attention_step(phi_q, phi_k, v.to(phi_k.dtype), S, z)
    return out.view(B, H, 1, D).to(q.dtype)


def linear_rows(timer, B):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HKV * G, 1, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, HKV, 1, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, HKV, 1, D, device="cuda", generator=g).bfloat16()
    rows = []
    S = torch.zeros(B, HKV, D, D, device="cuda")
    z = torch.zeros(B, HKV, D, device="cuda")
    nbytes = (S.numel() + z.numel()) * 4
    for name, fn in {"linear_decode_elu1": lambda: linear_decode_elu1(q, k, v, S, z),
                     "torch step (elu1)": lambda: elu1_torch_step(q, k, v, S, z)}.items():
        ms = timer(fn)
        rows.append({"op": "linear elu1 F64", "form": name, "batch": B, "ms": ms, "bytes": nbytes,
                     "GB/s": nbytes / ms / 1e6})
    Fh = 2 * D   # hedgehog's width, with a gated decay (factors per row)
    phi_q = torch.rand(B, HKV, G, 1, Fh, device="cuda", generator=g)
    phi_k = torch.rand(B, HKV, 1, Fh, device="cuda", generator=g)
    v32 = v.float()
    decay = torch.rand(B, HKV, Fh, device="cuda", generator=g) * 0.1 + 0.9
    S = torch.zeros(B, HKV, Fh, D, device="cuda")
    z = torch.zeros(B, HKV, Fh, device="cuda")
    nbytes = (S.numel() + z.numel()) * 4
    for name, fn in {"linear_decode": lambda: linear_decode(phi_q, phi_k, v32, S, z, decay),
                     "linear_attention_step": lambda: linear_attention_step(phi_q, phi_k, v32, S, z, decay)}.items():
        ms = timer(fn)
        rows.append({"op": "linear gated F128", "form": name, "batch": B, "ms": ms, "bytes": nbytes,
                     "GB/s": nbytes / ms / 1e6})
    return rows


def hedgehog_torch_map(fm, layer, q, k, v, S, z):
    """LinearState's decode step of a hedgehog map before the map was fused: the map, its gated decay in
    torch, then the fused step."""
    B, H = q.shape[:2]
    ld = fm.decay(layer, v)
    phi_k = fm(k, layer, "k")
    phi_q = fm(q, layer, "q").view(B, HKV, G, 1, phi_k.shape[-1])
    return linear_decode(phi_q, phi_k, v, S, z, ld[:, :, 0].exp(), out_dtype=q.dtype).view(B, H, 1, -1)


def hedgehog_rows(timer, B):
    fm = Hedgehog(2, HKV * G, HKV, D)
    fm.add_gate()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in fm.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    fm = fm.cuda().requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HKV * G, 1, D, device="cuda", generator=g).bfloat16()
    k, v = [torch.randn(B, HKV, 1, D, device="cuda", generator=g).bfloat16() for _ in range(2)]
    S = torch.zeros(B, HKV, 2 * D, D, device="cuda")
    z = torch.zeros(B, HKV, 2 * D, device="cuda")
    maps = hedgehog_layer(fm, 1)
    nbytes = (S.numel() + z.numel()) * 4
    forms = {"linear_decode_hedgehog": lambda: linear_decode_hedgehog(q, k, v, S, z, maps),
             "torch map + linear_decode": lambda: hedgehog_torch_map(fm, 1, q, k, v, S, z)}
    rows = []
    with torch.inference_mode():
        for name, fn in forms.items():
            ms = timer(fn)
            rows.append({"op": "hedgehog gated F128", "form": name, "batch": B, "ms": ms, "bytes": nbytes,
                         "GB/s": nbytes / ms / 1e6})
        saved = linear_kernels.HEDGEHOG_TILE, linear_kernels.HEDGEHOG_WARPS
        try:
            for tile in (1024, 2048, 4096, 8192):
                for warps in (4, 8):
                    linear_kernels.HEDGEHOG_TILE, linear_kernels.HEDGEHOG_WARPS = tile, warps
                    ms = timer(forms["linear_decode_hedgehog"])
                    rows.append({"op": "hedgehog gated F128", "form": f"kernel, tile {tile} x {warps} warps",
                                 "batch": B, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6})
        finally:
            linear_kernels.HEDGEHOG_TILE, linear_kernels.HEDGEHOG_WARPS = saved
    return rows


def table(rows) -> str:
    lines = ["| op | batch | depth | form | ms | GB/s |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['batch']} | {r.get('depth', '-')} | {r['form']} | {r['ms']:.4f} | "
                     f"{r['GB/s']:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu_kernels.py needs CUDA: torch.cuda.is_available() is False on this machine",
              file=sys.stderr)
        return 2
    probe = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    reason = why_not(probe)
    if reason:
        print(f"the Triton kernels will not run: {reason}", file=sys.stderr)
        return 2
    import triton
    timer = Timer(args.reps)
    rows = []
    for B in sorted({b for b, _ in args.shapes}):
        rows += linear_rows(timer, B)
        rows += hedgehog_rows(timer, B)
    for B, N in args.shapes:
        rows += softmax_rows(timer, B, N)
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}; Hkv {HKV}, G {G}, D {D}; "
          f"median of {args.reps} calls, L2 evicted before each")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                       "reps": args.reps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
