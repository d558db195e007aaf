"""The GPU anchor of issue 35: transformers' LlamaForCausalLM decoding with a static KV cache and
`torch.compile(mode="reduce-overhead")` (gpt-fast's recipe: CUDA graphs over a static cache), on a
Hugging Face directory, timed the way `gen bench` times decode (ms per one-token step at a depth).

    python benchmarks/hf_static_compile.py MODEL_DIR [--depth 1024] [--batch 1] [--steps 64]
        [--compile reduce-overhead|none] [--device cuda] [--json FILE]

Prefill `depth` random ids in one forward into a StaticCache of depth + warm-up + steps slots, then
time `steps` one-token forwards (greedy feedback, synchronised at the end) after `--warmup` untimed
ones (the compile and the graph capture happen there and are reported as `warmup_s`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def run(model_dir: str, depth: int, batch: int, steps: int, warmup: int, mode: str, device: str,
        dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM, StaticCache
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=depth + warmup + steps + 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, depth), generator=gen).to(device)

    def forward(tok, pos):
        return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

    step = torch.compile(forward, mode=mode, fullgraph=True) if mode != "none" else forward
    with torch.inference_mode():
        logits = forward(ids, torch.arange(depth, device=device))
        tok = logits[:, -1:].argmax(-1)
        pos = torch.tensor([depth], device=device)

        def seconds(n):     # n greedy one-token steps, synchronised at the end
            nonlocal tok
            t0 = time.perf_counter()
            for _ in range(n):
                tok = step(tok, pos).argmax(-1).clone()
                pos.add_(1)
            sync(device)
            return time.perf_counter() - t0

        warm = seconds(warmup)      # the compile and the graph capture happen here
        sec = seconds(steps)
    ms = sec / steps * 1e3
    return {"model": model_dir, "impl": f"transformers {__import__('transformers').__version__} StaticCache"
            + ("" if mode == "none" else f" + torch.compile({mode})"), "depth": depth, "batch": batch,
            "steps": steps, "ms_per_step": round(ms, 4), "tokens_per_s": round(batch * 1e3 / ms, 1),
            "warmup_s": round(warm, 2), "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
            "torch": torch.__version__}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--depth", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", dest="mode", default="reduce-overhead",
                   choices=["reduce-overhead", "max-autotune", "default", "none"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("hf_static_compile: --device cuda but no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf_static_compile: needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    r = run(a.model_dir, a.depth, a.batch, a.steps, a.warmup, a.mode, a.device, getattr(torch, a.dtype))
    print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
