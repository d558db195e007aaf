"""Tensor operations of one training row through the linear forms, with and without a learned decay.

    python benchmarks/decay_ops.py [--tokens 8192] [--block 512]
    PYTHONPATH=DIR python benchmarks/decay_ops.py     # another checkout's engine (a git worktree)

On a GPU the chunked forms of a long row are kernel-launch bound (a linearize step of an 8,192-token
row: 7.5 s with 64-token blocks against 1.2 s with 512 on an H200), so the count of tensor operations
the forward + backward of one layer's attention runs is a machine-independent proxy for what a
decayed finetune costs there. Counts torch.profiler's aten operations (views and allocations left
out) for the window + linear form (window 256) and the pure linear form, SmolLM2's head shapes with
16-wide heads (the count does not depend on the widths), at the stateless forms' GPU block length.
PYTHONPATH=DIR runs another checkout's engine (a `git worktree` of an older commit) for a before/after;
the engine used is printed.
"""
from __future__ import annotations

import json

import torch
from torch.profiler import ProfilerActivity, profile

import engine.attention.linear as lin
import engine.attention.window as win
from common import options
from engine.attention.feature_maps import Hedgehog

SKIP = {"aten::empty", "aten::view", "aten::as_strided", "aten::slice", "aten::select", "aten::expand",
        "aten::unsqueeze", "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::detach",
        "aten::alias", "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type"}


def main() -> None:
    ap = options(__doc__, tokens="8192", block="512")
    a = ap.parse_args()
    block = int(a.block)
    lin.stateless_chunk = win.stateless_chunk = lambda x: block   # the GPU's block, on this machine
    T = int(a.tokens)
    torch.manual_seed(0)
    out = {"tokens": T, "block": block, "engine": win.__file__, "ops": {}}
    for decay in ("none", "gated"):
        fm = Hedgehog(1, 9, 3, 16)
        if decay == "gated":
            fm.add_gate()
        q = torch.randn(1, 9, T, 16, requires_grad=True)
        k, v = torch.randn(1, 3, T, 16), torch.randn(1, 3, T, 16)
        for form, run in (("window 256", lambda: win.window_attention(q, k, v, fm, 256, None, 0)),
                          ("linear", lambda: lin.linear_attention(q, k, v, fm, None, 0))):
            with profile(activities=[ProfilerActivity.CPU]) as p:
                run().sum().backward()
            n = sum(e.count for e in p.key_averages() if e.key.startswith("aten::") and e.key not in SKIP)
            out["ops"][f"{form}, decay {decay}"] = n
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
