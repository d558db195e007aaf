"""The bench plot: decode ms/token and memory against context depth, one line per configuration
(softmax, linear, hybrid, window, ... side by side)."""
from __future__ import annotations

import os

from engine.bench.output import write_output
from engine.bench.report import by_path, entry
from engine.errors import InvalidArgumentError

STYLE = {"softmax": dict(color="tab:blue", marker="o"), "linear": dict(color="tab:orange", marker="s"),
         "hybrid": dict(color="tab:green", marker="^"), "window": dict(color="tab:purple", marker="D"),
         "default": dict(color="tab:red", marker="*")}


def plot_format(path: str | os.PathLike) -> str:
    """The image format `path` asks for by its extension (none: png); InvalidArgumentError, one line,
    for one matplotlib cannot write, so that a caller can refuse it before measuring anything."""
    from matplotlib.backend_bases import FigureCanvasBase
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if not suffix:
        return "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise InvalidArgumentError(f"{os.fspath(path)}: cannot write a plot as .{suffix}; name it .png, .svg or .pdf "
                                   f"(or {', '.join(sorted(set(formats) - {'png', 'svg', 'pdf'}))})")
    return suffix


def plot(report: dict, path: str | os.PathLike) -> str:
    """Write the two-panel plot (log-scale x) to `path`, in the format its extension names (PNG without
    one: the file is still named `path`); returns the path. InvalidArgumentError, one line, when it
    cannot be written."""
    fmt = plot_format(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = by_path(report["results"])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, recs in paths.items():
        ctx = [r["context"] for r in recs]
        style = STYLE.get(entry(recs[0]), {})
        label = name + (f" ({recs[0]['feature_map']})" if recs[0].get("feature_map") else "")
        ax_t.plot(ctx, [r["decode_ms_per_token"] for r in recs], label=label, **style)
        ax_t.fill_between(ctx, [r["decode_ms_per_token"] for r in recs],
                          [r["decode_ms_per_token_p90"] for r in recs], alpha=0.15, color=style.get("color"))
        ax_m.plot(ctx, [r["state_bytes"] / 2**20 for r in recs], label=f"{label}: state", **style)
        ax_m.plot(ctx, [r["peak_rss_bytes"] / 2**20 for r in recs], label=f"{label}: peak RSS",
                  linestyle="--", alpha=0.7, **style)
    cross = report.get("summary", {}).get("decode_crossover")
    if cross and cross.get("estimate"):
        ax_t.axvline(cross["estimate"], color="grey", linestyle=":", label=f"crossover ~{cross['estimate']}")
    trained = report["settings"]["model_info"]["max_position_embeddings"]
    for ax in (ax_t, ax_m):
        ax.axvline(trained, color="red", alpha=0.3, linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context depth (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    batched = any(r.get("batch", 1) > 1 for r in report["results"])
    ax_t.set_ylabel("decode ms/token" + (" of each sequence (one step)" if batched else "") + " (median; band to p90)")
    forms = sorted({r.get("step_form") or "?" for r in report["results"]})
    ax_t.set_title(f"decode latency (step: {', '.join(forms)})")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("MiB")
    ax_m.set_title(f"memory (red line: trained positions {trained})")
    ax_t.legend(fontsize=8)
    ax_m.legend(fontsize=7)
    s = report["settings"]
    m = s["machine"]
    # what the matrices held (a GGUF's blocks, e.g. q4_1+q8_0: not the float dtype)
    weights = ", ".join(sorted({str(r.get("weights") or s["dtype"]) for r in report["results"]})) or s["dtype"]
    fig.suptitle(f"{s['model']} - {m['cpu']}, {m['threads']} thread(s), {weights}, torch {m['torch']}",
                 fontsize=9)
    fig.tight_layout()
    try:   # engine.bench.output: a file whole or not at all, a link followed, a device or FIFO written in place
        return write_output(path, lambda f: fig.savefig(f, dpi=120, format=fmt), binary=True)
    finally:
        plt.close(fig)
