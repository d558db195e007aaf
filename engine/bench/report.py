"""Turn bench records into the machine description, the summary and a table (measurements only)."""
from __future__ import annotations

import math
import os
import platform

import torch

from engine.bench.memory import human, kv_cache_bytes, linear_state_bytes, total_bytes



def machine_info(threads: int | None = None) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "memory_bytes": total_bytes(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": threads or torch.get_num_threads()}


def label(r: dict) -> str:
    """A record's configuration label (records from before hybrid/window: its attention path)."""
    return r.get("configuration") or r["attention"]


def entry(r: dict) -> str:
    """The bench entry a record ran (softmax, linear, hybrid, window, default)."""
    return r.get("entry") or r["attention"]


def by_path(results: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by configuration label (softmax, linear, hybrid ..., in the order first met), by depth."""
    out: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["context"]):
        out.setdefault(label(r), []).append(r)
    return out


def relative_to_softmax(results: list[dict]) -> dict:
    """Per configuration and depth: its decode ms/token and state bytes over softmax's at that depth
    (the measured medians and nbytes; only depths where softmax ran)."""
    soft = {r["context"]: r for r in results if entry(r) == "softmax"}
    out: dict = {}
    for name, recs in by_path(results).items():
        if entry(recs[0]) == "softmax":
            continue
        rows = {str(r["context"]): {"decode_ms_per_token_ratio": r["decode_ms_per_token"] / s["decode_ms_per_token"],
                                    "state_bytes_ratio": r["state_bytes"] / s["state_bytes"]}
                for r in recs if (s := soft.get(r["context"])) is not None}
        if rows:
            out[name] = rows
    return out


def decode_crossover(results: list[dict]) -> dict | None:
    """The first depth at which linear decode is cheaper than softmax, with a log-x interpolation
    between the last depth where it was not and that one. None if either path is missing."""
    soft = {r["context"]: r["decode_ms_per_token"] for r in results if entry(r) == "softmax"}
    lin = {r["context"]: r["decode_ms_per_token"] for r in results if entry(r) == "linear"}
    if not soft or not lin:
        return None
    common = sorted(set(soft) & set(lin))
    prev = None
    for c in common:
        gap = lin[c] - soft[c]          # > 0: softmax still cheaper
        if gap < 0:
            if prev is None:
                return {"first_depth": c, "estimate": c, "note": "linear is cheaper already at the shallowest depth"}
            pc, pgap = prev
            t = pgap / (pgap - gap)      # where the gap crosses zero, linear in log(context)
            est = math.exp(math.log(pc) + t * (math.log(c) - math.log(pc)))
            return {"first_depth": c, "estimate": round(est), "note": f"between {pc} and {c}"}
        prev = (c, gap)
    return {"first_depth": None, "estimate": None, "note": f"softmax stays cheaper up to {common[-1]}"}


def memory_crossover(cfg, dtype, feature_map, linear_bytes: int | None = None, batch: int = 1) -> int:
    """Cache slots past which the KV cache holds more bytes than the (fixed) linear state
    (`linear_bytes`: the measured state, e.g. with a window; default: the formula's)."""
    per_slot = kv_cache_bytes(cfg, 1, dtype, batch)
    if linear_bytes is None:
        linear_bytes = linear_state_bytes(cfg, feature_map, dtype, batch)
    return math.ceil(linear_bytes / per_slot)


def summary_lines(report: dict) -> list[str]:
    s = report["settings"]
    m = s["machine"]
    lines = [f"machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {human(m['memory_bytes'])}; "
             f"{m['platform']}; python {m['python']}, torch {m['torch']}, {m['threads']} thread(s), "
             f"dtype {s['dtype']}, device {s['device']}"]
    model = s["model_info"]
    lines.append(f"model: {s['model']} ({model['parameters'] / 1e6:.2f}M parameters, L={model['layers']}, "
                 f"C={model['hidden_size']}, H={model['heads']}, Hkv={model['kv_heads']}, D={model['head_dim']}, "
                 f"trained positions {model['max_position_embeddings']})")
    forms = sorted({r.get("step_form") or "?" for r in report["results"]})
    step_kind = f"backend {s.get('backend', 'auto')}, step form(s) that ran: {', '.join(forms)}"
    lines.append(f"decode: {s['steps']} timed steps after {s['warmup']} warm-up steps, batch {s.get('batch', 1)}, "
                 f"greedy, EOS ignored, "
                 f"{step_kind}; "
                 f"peak RSS: {report['rss_method']}")
    cross = report["summary"].get("decode_crossover")
    if cross:
        if cross["first_depth"] is not None:
            lines.append(f"crossover: linear decode becomes cheaper than softmax at ~{cross['estimate']} tokens "
                         f"of context ({cross['note']}; first measured depth where it is: {cross['first_depth']})")
        else:
            lines.append(f"crossover: none measured ({cross['note']})")
    mem = report["summary"].get("memory_crossover_slots")
    if mem is not None:
        lines.append(f"memory: the KV cache outgrows the linear state past {mem} tokens "
                     f"(linear state {human(report['summary']['linear_state_bytes'])} at every depth)")
    for path, formula in report["summary"]["state_formulas"].items():
        if path in s["attentions"] or (path == "per layer" and {"hybrid", "window", "default"} & set(s["attentions"])):
            lines.append(f"state bytes ({path}): {formula}")
    for name, rows in report["summary"].get("vs_softmax", {}).items():
        cells = ", ".join(f"{c}: {v['decode_ms_per_token_ratio']:.2f}x decode, {v['state_bytes_ratio']:.3f}x state"
                          for c, v in rows.items())
        lines.append(f"{name} vs softmax: {cells}")
    bw = s.get("copy_bandwidth")
    if bw and any("floor_ms" in r for r in report["results"]):
        lines.append(f"floor: (weight bytes + state bytes a step reads at the depth) / {bw['bytes_per_s'] / 1e9:.1f} "
                     f"GB/s ({bw['method']}); x floor = decode ms/tok / floor ms")
    if any(r.get("depth_fill") == "repeat" for r in report["results"]):
        lines.append(f"depth: {s.get('prefill_tokens')} real tokens prefilled, the KV cache filled to the depth by "
                     f"repeating their keys/values (decode time depends on the depth, not the values)")
    if any(r["beyond_trained_positions"] for r in report["results"]):
        lines.append(f"* beyond the model's trained positions ({model['max_position_embeddings']}): "
                     f"timed and measured, but the model's outputs there are not meaningful")
    hf = report.get("compare_hf")
    if hf:
        lines.append(f"compare-hf: engine {hf['engine_tokens_per_s']:.0f} tok/s vs transformers {hf['transformers']} "
                     f"generate {hf['hf_tokens_per_s']:.0f} tok/s = {hf['ratio']:.2f}x ({hf['new_tokens']} greedy tokens "
                     f"after a {hf['prompt_tokens']}-token prompt, batch 1, median of {hf['repeats']}; "
                     f"same tokens: {hf['same_tokens']})")
    return lines


def step_label(r: dict) -> str:
    """The form that ran, the weights it read and the batch, e.g. `native q8_0 B8`."""
    parts = [r.get("step_form") or "?"]
    if r.get("weights"):
        parts.append(r["weights"])
    if r.get("batch", 1) > 1:
        parts.append(f"B{r['batch']} (ms/tok: each row's, one step; tok/s: all rows)")
    return " ".join(parts)


def format_table(results: list[dict]) -> str:
    floors = any("floor_ms" in r for r in results)   # (records from before the floor have none)
    head = ["attention", "context", "prefill s", "prefill tok/s", "decode ms/tok", "p90 ms", "decode tok/s",
            *(["floor ms", "x floor"] if floors else []), "state bytes", "peak RSS", "step"]
    rows = []
    for r in sorted(results, key=lambda r: (r["context"], label(r))):
        floor = [f"{r['floor_ms']:.3f}", f"{r['x_floor']:.1f}"] if "floor_ms" in r else ["-", "-"]
        rows.append([label(r) + (f" ({r['feature_map']})" if r.get("feature_map") else ""),
                     f"{r['context']}{'*' if r['beyond_trained_positions'] else ''}",
                     f"{r['prefill_s']:.3f}", f"{r['prefill_tokens_per_s']:.0f}",
                     f"{r['decode_ms_per_token']:.3f}", f"{r['decode_ms_per_token_p90']:.3f}",
                     f"{r['decode_tokens_per_s']:.0f}", *(floor if floors else []),
                     f"{r['state_bytes']} ({human(r['state_bytes'])})",
                     human(r["peak_rss_bytes"]), step_label(r)])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])
