"""Which attention configurations a bench run compares, and the run (a RunSpec preset) each one is.

`--attention` takes a comma-separated list of entries (or the aliases `both`, `all`):

    softmax   the base model unchanged (KV cache on every layer)
    linear    every layer a linear RNN; with --window W and no `window` entry, windowed (as `gen`)
    hybrid    --softmax-layers 2,9,11 | auto:K (default: the config's layer_attention) keep a KV
              cache, the rest linear; with --window W and no `window` entry, windowed linear layers
    window    every layer linear + a sliding window of W exact keys (--window W, or the config's)
    default   the checkpoint's own default configuration (e.g. smollm2-linear: hybrid + window)

    both = softmax,linear (the default);  all = softmax,linear,hybrid,window (the four-way plot)

Each entry is a RunSpec preset (`preset`): the entry's options resolved by `RunSpec.resolve`, the
function `gen`, `gen eval`, `gen serve` and the API resolve through, so a bench row runs what those
commands run with the same options (`--attention linear --window 64` here is `gen --attention linear
--window 64`). The memory formulas read a config: `spec.run_config(cfg)` (`runtime_for`).
"""
from __future__ import annotations

from engine.errors import InvalidArgumentError
from engine.runspec import RunSpec, check_attention, check_sparse_keys, check_window

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


def check_entries(entries, softmax_layers, window, sparse_keys=None) -> None:
    """What can be refused without the model (one line each)."""
    if softmax_layers is not None and "hybrid" not in entries:
        raise InvalidArgumentError("--softmax-layers applies to hybrid configurations: add hybrid to --attention "
                                   "(e.g. --attention softmax,hybrid)")
    check_window(window)
    if window is not None and not {"linear", "hybrid", "window"} & set(entries):
        raise InvalidArgumentError("--window applies to linear layers: add linear, hybrid or window to --attention")
    check_sparse_keys(sparse_keys)
    if sparse_keys and not ({"window", "default"} & set(entries) or (window and {"linear", "hybrid"} & set(entries))):
        raise InvalidArgumentError("--sparse-keys applies to linear layers with a window: add window or default to "
                                   "--attention, or give --window W")


def preset(cfg, entry: str, softmax_layers=None, window: int | None = None, sparse_keys: int | None = None,
           **settings) -> RunSpec:
    """The RunSpec of one entry on the checkpoint's config `cfg` (checked against the model); settings:
    the rest of the run as `RunSpec.resolve` takes it (feature_map, dtype, kv_dtype, device, backend,
    threads, quantize, ...). sparse_keys: entries whose linear layers run with a window (the others
    have none to keep)."""
    if entry == "softmax":
        return RunSpec.resolve(cfg, attention="softmax", **settings)
    if entry == "linear":
        return RunSpec.resolve(cfg, attention="linear", window=window, sparse_keys=sparse_keys if window else None,
                               **settings)
    if entry == "hybrid":
        return RunSpec.resolve(cfg, attention="hybrid", softmax_layers=softmax_layers, window=window,
                               sparse_keys=sparse_keys if window else None, **settings)
    if entry == "window":
        w = window if window is not None else (cfg.window or None)
        if w is None:
            raise InvalidArgumentError("the window configuration needs --window W (this model's config has no "
                                       "window), e.g. --window 64")
        return RunSpec.resolve(cfg, attention="linear", window=w, sparse_keys=sparse_keys, **settings)
    if entry == "default":
        return RunSpec.resolve(cfg, sparse_keys=sparse_keys, **settings)   # the checkpoint's own mode
    check_attention(entry, ENTRIES)


def runtime_for(cfg, entry: str, softmax_layers=None, window: int | None = None):
    """The config of one entry's run (`preset`) on `cfg`, for the formulas that read a config."""
    return preset(cfg, entry, softmax_layers, window).run_config(cfg)


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
    sparse = rt.sparse_keys if window else 0
    if sparse:
        label += f" + {sparse} sparse keys"
    return {"attention": rt.attention, "softmax_layers": soft if rt.attention == "hybrid" else None,
            "window": window, "sparse_keys": sparse, "configuration": label}


def layer_paths(rt) -> tuple[str, ...]:
    """Per layer "softmax" or "linear" for a runtime config."""
    if rt.attention == "hybrid":
        return tuple(rt.layer_attention)
    return (rt.attention,) * rt.num_hidden_layers


def configure(cfg, entry: str, softmax_layers=None, window: int | None = None, **settings):
    """(the entry's RunSpec, the record keys naming it) for one entry: entry, attention, softmax_layers,
    window, configuration (a label unique within a run: the default entry is prefixed "default:")."""
    spec = preset(cfg, entry, softmax_layers, window, **settings)
    keys = describe(spec.run_config(cfg))
    if entry == "default":
        keys["configuration"] = f"default: {keys['configuration']}"
    return spec, {"entry": entry, **keys}
