"""Decode speed, bytes read per token and resident memory of a K-quant GGUF (Q4_K_M's mix), public API only.

    python benchmarks/kquant_decode.py write --shape 1b --out /tmp/llama1b-q4km.gguf
    python benchmarks/kquant_decode.py run /tmp/llama1b-q4km.gguf --steps 32 --json out.json

`write` makes a random GGUF of a real model's shape (llama, qwen2 or qwen3 architecture) the way llama.cpp's Q4_K_M lays one out: q, k, o, gate, up
in Q4_K; v and down in Q6_K on the layers llama.cpp's `use_more_bits` picks (the first and last
eighth, every third between), Q4_K elsewhere; the output (or, tied, the token embedding) in Q6_K;
norms F32. The blocks are random (valid fp16 scales giving weights of std ~0.05): the gguf package
cannot quantize K-quants, and speed and memory do not depend on the values. --base q5_k: Q5_K_M.
Biases (Qwen2) and q/k norms (Qwen3) are F32 as llama.cpp writes them. The file says
`tokenizer.ggml.model` "none" (no vocabulary: llama.cpp's tools load it; prompts are token ids).

`run` loads it (engine.load), then prints one JSON record: RSS after load, the bytes of the matrices
one decode step reads (per layer qkv, o, gate_up, down, and lm_head, as the model holds them:
blocks, or floats where a loader dequantized them), and decode ms/token (median of --steps greedy
steps after a short prompt and --warmup steps) of the native step with q8 and f32 activations, and
prompt tokens/s of one --prompt-token block under the default activations (f32-prompt, best of 4).
Run it under another checkout's PYTHONPATH to compare (e.g. git main, which dequantized K-quants at
load).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

SHAPES = {   # Llama-3.2-1B's dimensions (Mistral's GGUFs are written as llama too); Qwen2.5-1.5B's
    # (q/k/v biases) and Qwen3-1.7B's (per-head q/k norms, head_dim 128 != hidden / heads); a ~0.3B
    # model with a 32k vocabulary
    "1b": dict(hidden=2048, inter=8192, layers=16, heads=32, kv=8, vocab=128256, tied=True),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936,
                         tied=True, theta=1000000.0, eps=1e-6),
    "qwen3-1.7b": dict(arch="qwen3", hidden=2048, inter=6144, layers=28, heads=16, kv=8, head_dim=128,
                       vocab=151936, tied=True, theta=1000000.0, eps=1e-6),
    "300m": dict(hidden=1024, inter=2816, layers=16, heads=16, kv=4, vocab=32000, tied=False),
}
WEIGHT_STD = {"Q4_K": 257.0, "Q5_K": 520.0, "Q6_K": 1370.0}   # std of a weight / d over random bytes


def more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    import gguf
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(rows, cols // block)) * 0.05 / WEIGHT_STD[qtype.name]).astype(np.float16)
    half = d.view(np.uint8).reshape(rows, cols // block, 2)
    if qtype.name == "Q6_K":
        raw[..., nbytes - 2:] = half
    else:
        raw[..., 0:2] = half
        dmin = (d * (7.5 if qtype.name == "Q4_K" else 15.5)).astype(np.float16)   # centres the weights near 0
        raw[..., 2:4] = dmin.view(np.uint8).reshape(half.shape)
    return raw.reshape(rows, -1)


def write(shape: str, out: str, base: str) -> None:
    import gguf
    Q = gguf.GGMLQuantizationType
    s, rng = SHAPES[shape], np.random.default_rng(0)
    base_t = Q.Q4_K if base == "q4_k" else Q.Q5_K
    C, I, L, H, Hkv, V = s["hidden"], s["inter"], s["layers"], s["heads"], s["kv"], s["vocab"]
    D, arch = s.get("head_dim", C // H), s.get("arch", "llama")
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(C)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(s.get("theta", 500000.0))
    w.add_layer_norm_rms_eps(s.get("eps", 1e-5))
    w.add_rope_dimension_count(D)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_vocab_size(V)
    w.add_tokenizer_model("none")

    def mat(name, rows, cols, qtype):
        w.add_tensor(name, random_blocks(rows, cols, qtype, rng), raw_dtype=qtype)

    mat("token_embd.weight", V, C, Q.Q6_K if s["tied"] else base_t)
    if not s["tied"]:
        mat("output.weight", V, C, Q.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(C, dtype=np.float32))
    for i in range(L):
        more = more_bits(i, L)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(C, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(C, dtype=np.float32))
        if arch == "qwen2":
            for n, rows in (("q", H * D), ("k", Hkv * D), ("v", Hkv * D)):
                w.add_tensor(f"blk.{i}.attn_{n}.bias", rng.normal(0, 0.02, rows).astype(np.float32))
        if arch == "qwen3":
            for n in ("q", "k"):
                w.add_tensor(f"blk.{i}.attn_{n}_norm.weight", np.ones(D, dtype=np.float32))
        mat(f"blk.{i}.attn_q.weight", H * D, C, base_t)
        mat(f"blk.{i}.attn_k.weight", Hkv * D, C, base_t)
        mat(f"blk.{i}.attn_v.weight", Hkv * D, C, Q.Q6_K if more else base_t)
        mat(f"blk.{i}.attn_output.weight", C, H * D, base_t)
        mat(f"blk.{i}.ffn_gate.weight", I, C, base_t)
        mat(f"blk.{i}.ffn_up.weight", I, C, base_t)
        mat(f"blk.{i}.ffn_down.weight", C, I, Q.Q6_K if more else base_t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}: {os.path.getsize(out) / 1e6:.0f} MB")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


def matrix_bytes(model) -> int:
    """Bytes of the matrices a decode step reads, as the model holds them (blocks or float weights)."""
    mods = [m for b in model.layers for m in (b.self_attn.qkv, b.self_attn.o_proj, b.mlp.gate_up, b.mlp.down_proj)]
    mods.append(model.lm_head)
    return sum(m.blocks.numel() if hasattr(m, "blocks") else m.weight.nbytes for m in mods)


def decode_ms(llm, steps: int, warmup: int) -> float:
    model = llm.model
    state = model.init_state(1, 16 + steps + warmup + 1, "softmax")
    prompt = torch.arange(3, 19).reshape(1, -1)
    with torch.inference_mode():
        logits = llm.step(prompt, state, last_only=True)
        times = []
        for i in range(warmup + steps):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            logits = llm.step(tok, state)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def prefill_tps(llm, tokens: int, repeats: int = 4) -> float:
    """Prompt tokens per second of one block of `tokens` (the best of `repeats`, after one untimed:
    on a shared machine the best run is the one least disturbed)."""
    prompt = (torch.arange(tokens) % 1000 + 3).reshape(1, -1)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            state = llm.model.init_state(1, tokens + 1, "softmax")
            t0 = time.perf_counter()
            llm.step(prompt, state, last_only=True)
            if i:
                times.append(time.perf_counter() - t0)
    return tokens / min(times)


def run(path: str, steps: int, warmup: int, threads: int | None, prompt: int) -> dict:
    import engine
    from engine import load
    from runs import with_run
    base = rss_mb()
    t0 = time.perf_counter()
    llm = load(path, attention="softmax", backend="native", threads=threads, activations="q8")
    load_s = time.perf_counter() - t0
    rec = {"engine": os.path.dirname(engine.__file__), "file_mb": os.path.getsize(path) / 1e6,
           "rss_before_load_mb": round(base), "rss_after_load_mb": round(rss_mb()), "load_s": round(load_s, 1),
           "matrix_mb_per_token": round(matrix_bytes(llm.model) / 1e6, 1), "threads": threads}
    rec["decode_ms_q8"] = round(decode_ms(llm, steps, warmup), 2)
    rec["rss_after_decode_mb"] = round(rss_mb())
    llm = with_run(llm, activations="f32-prompt")   # the default
    rec[f"prefill_{prompt}_tokens_per_s"] = round(prefill_tps(llm, prompt), 1)
    rec["prefill_form"] = llm.step.last_prefill_form
    # fp32 activations on the same model (a second load would hold the weights twice)
    llm = with_run(llm, activations="f32")
    rec["decode_ms_f32"] = round(decode_ms(llm, steps, warmup), 2)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--shape", choices=list(SHAPES), default="1b")
    w.add_argument("--base", choices=["q4_k", "q5_k"], default="q4_k")
    w.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("path")
    r.add_argument("--steps", type=int, default=32)
    r.add_argument("--warmup", type=int, default=4)
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--prompt", type=int, default=128, help="prompt tokens of the timed prefill")
    r.add_argument("--json")
    a = ap.parse_args()
    if a.cmd == "write":
        write(a.shape, a.out, a.base)
        return
    rec = run(a.path, a.steps, a.warmup, a.threads, a.prompt)
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
