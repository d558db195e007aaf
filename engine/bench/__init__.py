"""`gen bench`: decode memory and latency of softmax vs linear attention on the same weights.

    from engine.bench import BenchSettings, run_bench
    report = run_bench(BenchSettings(model="tiny", contexts=(128, 2048)))

Modules: `sweep` (one configuration, in-process or in a fresh subprocess), `memory` (state
bytes by formula, up-front refusal of depths the machine cannot hold, peak RSS), `report`
(machine, summary, crossover, target checks, table), `plot`, `hf_compare`, `output` (the --json and
--plot files: a file replaced whole, a link followed, a device or FIFO written in place).
"""
from __future__ import annotations

import json
import os

import torch

from tqdm import tqdm

from engine.bench.hf_compare import DEFAULT_PROMPT
from engine.bench.hf_compare import compare_hf as run_compare
from engine.bench.configs import layer_paths
from engine.bench.floor import copy_bandwidth, floor_ms
from engine.bench.memory import available_bytes, check_fits, run_bytes
from engine.bench.output import write_output
from engine.bench.report import decode_crossover, machine_info, memory_crossover, relative_to_softmax
from engine.loader import load_model
from engine.quant import quantize_model
from engine.threads import default_threads, set_threads
from models.registry import resolve
from engine.bench.sweep import (DEFAULT_CONTEXTS, BenchError, BenchSettings, run_in_process,
                                run_isolated)

STATE_FORMULAS = {
    "softmax": "2 * L * B * Hkv * D * T * bytes(dtype)   (T = slots the cache holds)",
    "linear": "L * B * Hkv * (F * Dv + F) * 4   (fp32; per key/value head under GQA; F = feature_map.out_dim(D))",
    "per layer": ("sum over layers: softmax layer 2 * B * Hkv * D * T * bytes(dtype); linear layer "
                  "B * Hkv * (F * Dv + F) * 4 + 2 * B * Hkv * W * D * bytes(dtype)   (W = window, 0 without; with M sparse "
                  "keys W + 63 + M: the recent keys up to a decision's 64 and the cached ones)"),
}

__all__ = ["BenchSettings", "BenchError", "DEFAULT_CONTEXTS", "run_bench", "write_json"]


def model_info(model) -> dict:
    """Parameters and weight bytes: float parameters, and quantized matrices (engine.quant: blocks
    buffers, counted as their rows x columns and their blocks' bytes; a tied head counted once)."""
    cfg = model.config
    seen, n_params, n_bytes = set(), 0, 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n_params += p.numel()
            n_bytes += p.numel() * p.element_size()
    for m in model.modules():
        blocks = getattr(m, "blocks", None)
        key = isinstance(blocks, torch.Tensor) and (blocks.data_ptr(), blocks.numel())
        if key and hasattr(m, "in_features") and key not in seen:   # a tied head: a view of the same bytes
            seen.add(key)
            n_params += m.in_features * m.out_features
            n_bytes += blocks.numel() * blocks.element_size()
    return {"parameters": n_params, "weight_bytes": n_bytes, "layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "trained_for": list(cfg.trained_for)}


def run_bench(settings: BenchSettings, compare_hf: bool = False, hf_new_tokens: int = 128,
              hf_prompt: str | None = None, hf_repeats: int = 3, progress: bool = True) -> dict:
    """Run the sweep (and the transformers comparison); returns the report dict (JSON-ready).

    Every configuration is checked against MemAvailable before the first one runs. Ctrl-C
    (KeyboardInterrupt) stops the sweep: the report then holds the configurations that finished and
    `interrupted` = {"finished": n, "configurations": total}.
    """
    set_threads(settings.threads)
    path = resolve(settings.model)
    model, tokenizer = load_model(path, device=settings.device, dtype=settings.dtype, kv_dtype=settings.kv_dtype)
    if settings.quantize:
        quantize_model(model, settings.quantize)
    info = model_info(model)
    fmap = settings.feature_map or model.config.feature_map
    configs = settings.configurations()
    runtimes = {a: settings.runtime(model.config, a) for a in settings.attentions}   # bad layers etc.: refused now
    check_fits([(runtimes[a][1]["configuration"], c,
                 run_bytes(runtimes[a][0], runtimes[a][0].attention, settings.prefilled(c), settings.slots(c),
                           model.dtype, info["weight_bytes"], fmap, settings.batch))
                for a, c in configs], batch=settings.batch)

    bandwidth = copy_bandwidth(model.device)   # once per run, before the sweep (engine.bench.floor)
    results = []
    failed = []   # a configuration that failed (a worker killed for memory): the others still run and report
    bar = tqdm(configs, desc="gen bench", unit="config", disable=not progress, leave=False)
    try:
        for attention, context in bar:
            bar.set_postfix_str(f"{attention} @ {context}")
            try:
                if settings.isolate:
                    results.append(run_isolated(str(path), settings, attention, context))
                else:
                    results.append(run_in_process(model, settings, attention, context))
            except BenchError as e:
                failed.append({"attention": attention, "context": context, "error": str(e)})
        interrupted = None
    except KeyboardInterrupt:   # Ctrl-C: report the configurations that finished
        interrupted = {"finished": len(results), "configurations": len(configs)}
    bar.close()
    for rec in results:
        floor = floor_ms(rec, bandwidth["bytes_per_s"])
        if floor is not None:
            rec["floor_ms"], rec["x_floor"] = floor, rec["decode_ms_per_token"] / floor

    report = {
        "settings": {**settings.to_dict(), "model_path": str(path), "feature_map": fmap,
                     "machine": machine_info(settings.threads or default_threads()), "model_info": info,
                     "available_bytes_at_start": available_bytes(), "copy_bandwidth": bandwidth},
        "rss_method": results[0]["rss_method"] if results else None,
        "results": results,
    }
    if interrupted:
        report["interrupted"] = interrupted
    if failed:
        report["failed"] = failed
    summary: dict = {"decode_crossover": decode_crossover(results), "state_formulas": STATE_FORMULAS,
                     "configurations": {keys["configuration"]: {**keys, "layer_attention": list(layer_paths(rt))}
                                        for rt, keys in runtimes.values()},
                     "vs_softmax": relative_to_softmax(results)}
    linear_bytes = next((r["state_bytes"] for r in results if r.get("entry") == "linear"), None)
    if linear_bytes is not None:   # (None: no linear configuration ran, or none finished)
        summary["linear_state_bytes"] = linear_bytes
        summary["memory_crossover_slots"] = memory_crossover(model.config, model.kv_dtype or model.dtype, fmap,
                                                             summary["linear_state_bytes"], settings.batch)
    report["summary"] = summary
    if compare_hf and not interrupted:
        report["compare_hf"] = run_compare(path, model, tokenizer, new_tokens=hf_new_tokens,
                                           prompt=hf_prompt or DEFAULT_PROMPT, repeats=hf_repeats)
    return report


def write_json(report: dict, path: str | os.PathLike) -> None:
    """Write the report to `path` (engine.bench.output: a file whole or not at all, a link followed, a
    device or FIFO written in place); InvalidArgumentError, one line, when it cannot be written."""
    write_output(path, lambda f: f.write(json.dumps(report, indent=2) + "\n"))
