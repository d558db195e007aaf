"""Which attention configurations a bench run compares, and the runtime config each one runs.

`--attention` takes a comma-separated list of entries (or the aliases `both`, `all`):

    softmax   the base model unchanged (KV cache on every layer)
    linear    every layer a linear RNN; with --window W and no `window` entry, windowed (as `gen`)
    hybrid    --softmax-layers 2,9,11 | auto:K (default: the config's layer_attention) keep a KV
              cache, the rest linear; with --window W and no `window` entry, windowed linear layers
    window    every layer linear + a sliding window of W exact keys (--window W, or the config's)
    default   the checkpoint's own default configuration (e.g. smollm2-linear: hybrid + window)

    both = softmax,linear (the default);  all = softmax,linear,hybrid,window (the four-way plot)

Each entry is turned into a runtime config by `engine.attention.hybrid.runtime_config`, the
same function `gen`, `gen eval` and the API use, so a bench row runs what those commands run.
"""
from __future__ import annotations

from engine.attention.hybrid import runtime_config
from engine.errors import InvalidArgumentError
from engine.runspec import check_attention, check_window

ENTRIES = ("softmax", "linear", "hybrid", "window", "default")
ALIASES = {"both": ("softmax", "linear"), "all": ("softmax", "linear", "hybrid", "window")}


def parse_attentions(value) -> tuple[str, ...]:
    """"softmax,hybrid", "both", ("softmax", "linear") -> the entries in order, no repeats."""
    items = value.replace(" ", "").split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        if not item:
            continue
        check_attention(item, ENTRIES + tuple(ALIASES), " for gen bench (comma-separated)")
        for e in ALIASES.get(item, (item,)):
            if e not in out:
                out.append(e)
    if not out:
        raise InvalidArgumentError("--attention names no configuration; e.g. softmax,linear,hybrid,window")
    return tuple(out)


def entry_window(entry: str, entries, window: int | None) -> int | None:
    """The window an entry runs with: `window` always takes --window; linear and hybrid take it
    only when no `window` entry is listed (then `--attention linear --window W` means what `gen` does)."""
    if entry == "window" or (entry in ("linear", "hybrid") and "window" not in entries):
        return window
    return None


def check_entries(entries, softmax_layers, window) -> None:
    """What can be refused without the model (one line each)."""
    if softmax_layers is not None and "hybrid" not in entries:
        raise InvalidArgumentError("--softmax-layers applies to hybrid configurations: add hybrid to --attention "
                                   "(e.g. --attention softmax,hybrid)")
    check_window(window)
    if window is not None and not {"linear", "hybrid", "window"} & set(entries):
        raise InvalidArgumentError("--window applies to linear layers: add linear, hybrid or window to --attention")


def runtime_for(cfg, entry: str, softmax_layers=None, window: int | None = None):
    """The runtime config of one entry on the checkpoint's config `cfg` (checked against the model)."""
    if entry == "softmax":
        return runtime_config(cfg, "softmax")
    if entry == "linear":
        return runtime_config(cfg, "linear", window=window)
    if entry == "hybrid":
        return runtime_config(cfg, "hybrid", softmax_layers, window)
    if entry == "window":
        w = window if window is not None else (cfg.window or None)
        if w is None:
            raise InvalidArgumentError("the window configuration needs --window W (this model's config has no "
                                       "window), e.g. --window 64")
        return runtime_config(cfg, "linear", window=w)
    if entry == "default":
        return cfg
    check_attention(entry, ENTRIES)


def describe(rt) -> dict:
    """JSON keys naming a runtime config: attention, softmax_layers, window, configuration (a label)."""
    L = rt.num_hidden_layers
    soft = ([i for i, p in enumerate(rt.layer_attention) if p == "softmax"]
            if rt.attention == "hybrid" else (list(range(L)) if rt.attention == "softmax" else []))
    window = rt.window if rt.attention != "softmax" else 0
    if rt.attention == "hybrid":
        label = f"hybrid {len(soft)}/{L} softmax"
    else:
        label = rt.attention
    if window:
        label += f" + window {window}"
    return {"attention": rt.attention, "softmax_layers": soft if rt.attention == "hybrid" else None,
            "window": window, "configuration": label}


def layer_paths(rt) -> tuple[str, ...]:
    """Per layer "softmax" or "linear" for a runtime config."""
    if rt.attention == "hybrid":
        return tuple(rt.layer_attention)
    return (rt.attention,) * rt.num_hidden_layers


def configure(cfg, entry: str, softmax_layers=None, window: int | None = None):
    """(runtime config, the record keys naming it) for one entry: entry, attention, softmax_layers,
    window, configuration (a label unique within a run: the default entry is prefixed "default:")."""
    rt = runtime_for(cfg, entry, softmax_layers, window)
    keys = describe(rt)
    if entry == "default":
        keys["configuration"] = f"default: {keys['configuration']}"
    return rt, {"entry": entry, **keys}
