"""What one run is: the attention per layer, window, feature map and map set, dtypes, device, step
backend, threads, quantization -- resolved once from the checkpoint's config and the user's options.

    spec = RunSpec.resolve(cfg, attention="hybrid", softmax_layers="auto:4", window=64, threads=2)
    spec.attention, spec.layer_attention, spec.window, spec.map_set, spec.threads
    model.init_state(batch=1, spec=spec); model(tokens, spec=spec)
    spec.for_request(cfg, attention="linear")     # a server request: the same rules, on the same model

Every rule about these options is written here once, and everything else calls it: the attention
names (`check_attention`), the window's bounds (`check_window`), the thread count and default (`engine.threads.check_threads` and
`default_threads`, one layer down, read by `resolve`), the step backends, activations, quantization
kinds, prefill chunk, dtypes and devices.
The CLI, the API, the server, bench and eval all resolve through `RunSpec.resolve` or `for_request`;
the model keeps the checkpoint's config untouched (`engine.loader` never reassigns it).

Not here: GOMP_SPINCOUNT (engine/__init__.py). libgomp reads it once, in its load-time constructor
(initialize_env), which runs when torch is first imported; any later setting is never read, so it
cannot be set where the native pool starts (the pool is ours, not libgomp's, and starts long after
torch). It stays a default set at `import engine`, before torch, never over the user's own setting.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from engine.errors import InvalidArgumentError
from engine.threads import ThreadsError, check_threads, default_threads  # noqa: F401 (re-exported)
from models.config import ATTENTION_PATHS, ModelConfig

BACKENDS = ("auto", "torch", "native", "module", "graph", "compiled")
ACTIVATIONS = ("f32-prompt", "f32", "q8")
QUANT_KINDS = ("q8_0", "q4_0", "q4_1")
# Prompt blocks run in chunks of at most this many tokens (`prefill_chunk`, `--prefill-chunk`): the
# server runs one chunk between decode steps so a long prompt cannot freeze the streams already running,
# and every caller chunks alike, so a request gives the same tokens from the API, the CLI and the server.
# 16 measured best on SmolLM2 Q4_1 (2 cores, C step): 324 prefill tokens/s against 139 for 512-token
# blocks, a chunk ~38 ms next to a 12 ms decode step (benchmarks/prefill_chunk.py).
# The default (None) picks per model: NATIVE_PREFILL_CHUNK where the C step prefills the prompt blocks
# (a CPU, f16 or quantized weights), MODULE_PREFILL_CHUNK on the PyTorch path (a GPU, fp32 / bf16 weights,
# --backend torch): there each block re-reads, and dequantizes, every weight, ~400 tensor operations a
# token at 16 (SmolLM2 Q4_1, 600 tokens on one core: 21.6 s in blocks of 16, 2.9 s in blocks of 512; on a
# GPU each operation is a kernel launch). An int given is used on every path.
DEFAULT_PREFILL_CHUNK = None
NATIVE_PREFILL_CHUNK = 16
MODULE_PREFILL_CHUNK = 512
# What quantized weights multiply in the native step (engine.steps.native.NativeStep): "f32" activations
# (PyTorch's arithmetic) or "q8" (activations rounded to q8 blocks, llama.cpp's); see benchmarks/quant_activations.py.
DEFAULT_ACTIVATIONS = "f32-prompt"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
NO_WINDOW = "no_window"   # the map set for runs whose linear layers have no window (models.linearized.VARIANTS)


# ---------------------------------------------------------------------- the rules, each once
class UnknownAttentionError(InvalidArgumentError):
    """An attention name that is not a path (or, for gen bench, an entry)."""


class WindowError(InvalidArgumentError):
    """A window below 1, or a window where no layer is linear."""


def check_attention(name, valid=ATTENTION_PATHS, what: str = "") -> str:
    """`name` must be one of `valid` (default: the attention paths); `what` names the command."""
    if name not in valid:
        raise UnknownAttentionError(f"unknown attention {name!r}{what}; valid: {', '.join(valid)}")
    return name


def check_window(window) -> int | None:
    """None (no window) or an integer >= 1: the keys each linear layer sees exactly."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise WindowError(f"--window must be at least 1 (the keys each linear layer sees exactly), "
                          f"got {window!r}; leave it out for pure linear layers")
    return window


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    return backend


def check_activations(activations) -> str:
    if activations not in ACTIVATIONS:
        raise InvalidArgumentError(f"activations must be one of {', '.join(ACTIVATIONS)} (what quantized weights "
                                   f"multiply in the native step), got {activations!r}")
    return activations


def check_quantize(kind) -> str:
    if kind not in QUANT_KINDS:
        raise InvalidArgumentError(f"unknown quantization {kind!r}; valid: {', '.join(QUANT_KINDS)}")
    return kind


def check_prefill_chunk(chunk) -> int | None:
    """None = the default for the path that prefills (DEFAULT_PREFILL_CHUNK); 0 = whole prompts in one
    block; else a positive token count."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise InvalidArgumentError(f"prefill_chunk must be a non-negative integer (0: the whole prompt in one "
                                   f"block) or None (the path's default), got {chunk!r}")
    return chunk


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None:
        return name
    if isinstance(name, torch.dtype):
        if name not in set(DTYPES.values()) | {torch.float64}:   # float64: references and tests
            raise InvalidArgumentError(f"dtype {name} is not one the weights can run in; valid: float32, float16, "
                                       f"bfloat16")
        return name
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown dtype {name!r}; valid: float32, float16, bfloat16") from None


def parse_device(device: str | torch.device) -> torch.device:
    """A torch device this machine has; otherwise an InvalidArgumentError saying what it has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {device!r} asked for, but this torch build or machine has no CUDA; "
                                   f"use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidArgumentError(f"device {device!r} does not exist; this machine has "
                                   f"{torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
        has = backend is not None and getattr(backend, "is_available", lambda: False)()
        what = "is not available on this machine" if not has else "is not supported by this engine"
        raise InvalidArgumentError(f"device {device!r} {what}; use --device cpu (or cuda where a GPU exists)")
    return dev


# ---------------------------------------------------------------------- softmax layers of a hybrid
def layer_attention_for(num_layers: int, softmax_layers) -> tuple[str, ...]:
    """Per-layer paths from the list of softmax layers (checked: one line naming a bad layer)."""
    for i in softmax_layers:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers:
            raise InvalidArgumentError(f"softmax layer {i!r} does not exist; the model has {num_layers} layers "
                                       f"(0-{num_layers - 1})")
    twice = sorted({i for i in softmax_layers if list(softmax_layers).count(i) > 1})
    if twice:
        raise InvalidArgumentError(f"softmax layer {twice[0]} is listed twice; list each layer once")
    return tuple("softmax" if i in set(softmax_layers) else "linear" for i in range(num_layers))


def highest_loss_layers(relative, k: int) -> list[int]:
    """The k layers with the highest relative transfer loss (what `--softmax-layers auto:K` keeps)."""
    return sorted(sorted(range(len(relative)), key=lambda j: (-relative[j], j))[:k])


def layer_numbers(text: str, alternative: str = "") -> list[int]:
    """--softmax-layers "2,9,11" -> [2, 9, 11] (empty items skipped; each layer checked against a model later)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not all(re.fullmatch(r"[+-]?[0-9]+", x) for x in items):   # ASCII digits: int() also reads "١" and "1_0"
        raise InvalidArgumentError(f"--softmax-layers {text}: give layer numbers like 2,9,11{alternative}")
    return [int(x) for x in items]


def parse_softmax_layers(spec, cfg) -> tuple[str, ...]:
    """"2,9,11", [2, 9, 11] or "auto:K" (needs the config's transfer_loss) -> per-layer paths."""
    L = cfg.num_hidden_layers
    if isinstance(spec, str) and spec.startswith("auto:"):
        try:
            k = int(spec[5:])
        except ValueError:
            raise InvalidArgumentError(f"--softmax-layers {spec}: auto:K needs a whole number K") from None
        if not 0 <= k <= L:
            raise InvalidArgumentError(f"--softmax-layers {spec}: K must be 0..{L} (the model has {L} layers)")
        if cfg.transfer_loss is None:
            raise InvalidArgumentError(f"--softmax-layers {spec} needs the transfer losses gen linearize records; "
                                       f"this model has none: list the layers (e.g. 2,9,11)")
        return layer_attention_for(L, highest_loss_layers(cfg.transfer_loss, k))
    given = spec
    if isinstance(spec, str):
        spec = layer_numbers(spec, " or auto:K")
    if not isinstance(spec, (list, tuple, range)) or any(isinstance(i, bool) or not isinstance(i, int) for i in spec):
        raise InvalidArgumentError(f"softmax_layers must be a list of layer numbers ([2, 9, 11]), \"2,9,11\" or "
                                   f"\"auto:K\", got {spec!r:.60}")
    if not spec:   # a hybrid without softmax layers is linear attention under another name
        raise InvalidArgumentError(f"--softmax-layers {given!r:.60} names no layer: give layer numbers like 2,9,11 or "
                                   f"auto:K (no softmax layer at all: --attention linear)")
    return layer_attention_for(L, list(spec))


HYBRID_NEEDS_LAYERS = ("hybrid attention needs the softmax layers: --softmax-layers 2,9,11 or auto:K "
                       "(API: softmax_layers=[...]) or layer_attention in config.json")


# ---------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class RunSpec:
    """One run's configuration, resolved and checked (`resolve`); frozen and hashable (a server keys
    its batches on it). The model's config stays the checkpoint's: the path per layer, window and
    feature map a run uses come from here."""
    attention: str = "softmax"                      # softmax | linear | hybrid
    layer_attention: tuple[str, ...] | None = None  # hybrid: per layer softmax or linear
    window: int = 0                                 # linear layers also attend exactly to the last W keys
    sparse_keys: int = 0                            # with a window: M hard keys per layer and head kept exact (LoLA)
    feature_map: str = "elu1"                       # the linear layers' feature map (hedgehog: learned)
    map_set: str | None = None                      # which set of a linearized directory's maps (None: default)
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None             # None: dtype
    device: torch.device = torch.device("cpu")
    backend: str = "auto"
    threads: int = dataclasses.field(default_factory=default_threads)   # the native pool (the caller included)
    torch_threads: int = 1                          # PyTorch's intra-op pool
    quantize: str | None = None
    activations: str = DEFAULT_ACTIVATIONS
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK

    @classmethod
    def resolve(cls, cfg: ModelConfig, *, attention: str | None = None, softmax_layers=None,
                window: int | None = None, feature_map: str | None = None, dtype=None, kv_dtype=None,
                device="cpu", backend: str = "auto", native: bool = False, threads: int | None = None,
                quantize: str | None = None, activations: str = DEFAULT_ACTIVATIONS,
                prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, sparse_keys: int | None = None) -> "RunSpec":
        """The run `cfg` (the checkpoint's config) and the user's options ask for; nothing given: the
        checkpoint's own default. attention="softmax": the base model unchanged; "linear" without
        `window`: every layer a pure linear RNN; `softmax_layers` ("2,9,11", [2, 9, 11], "auto:K")
        implies hybrid, and hybrid without it takes the config's layer_attention. threads None: the
        native pool on every core (`default_threads`), PyTorch on 1; N: both on N. The feature map's
        name is checked where it is looked up (engine.attention.get_feature_map, a layer above)."""
        mode = resolve_mode(cfg, attention, softmax_layers, window, sparse_keys)
        check_threads(threads)
        if native and backend not in ("auto", "native"):   # (gen's --native with --backend: the same line)
            raise InvalidArgumentError(f"native=True is backend='native', and backend={backend!r} asks for another "
                                       "step form; give one of them")
        return cls(**mode, feature_map=feature_map or cfg.feature_map,
                   dtype=parse_dtype(dtype) or torch.float32, kv_dtype=parse_dtype(kv_dtype),
                   device=parse_device(device), backend="native" if native else check_backend(backend),
                   threads=default_threads() if threads is None else threads,
                   torch_threads=1 if threads is None else threads,
                   quantize=None if quantize is None else check_quantize(quantize),
                   activations=check_activations(activations), prefill_chunk=check_prefill_chunk(prefill_chunk))

    @classmethod
    def from_config(cls, cfg: ModelConfig, attention: str | None = None, feature_map: str | None = None,
                    **settings) -> "RunSpec":
        """The mode a config names as it stands (its attention, layer_attention and window; `attention`
        another path on the same layers and window): what a model runs when given no spec."""
        path = check_attention(cfg.attention if attention is None else attention)
        layers = None
        if path == "hybrid":
            if cfg.layer_attention is None:
                raise InvalidArgumentError(HYBRID_NEEDS_LAYERS)
            layers = tuple(cfg.layer_attention)
        return cls(attention=path, layer_attention=layers, window=cfg.window,   # (a softmax run reads none)
                   sparse_keys=cfg.sparse_keys if cfg.window else 0,
                   map_set=map_set_for(path, cfg.window), feature_map=feature_map or cfg.feature_map, **settings)

    def with_path(self, cfg: ModelConfig, attention: str | None = None, feature_map: str | None = None) -> "RunSpec":
        """This run on another path with the same window (hybrid: this run's layers, else the config's)
        and map set, or with another feature map: what `init_state(attention=...)` without a spec means."""
        path = check_attention(self.attention if attention is None else attention)
        layers = None
        if path == "hybrid":
            layers = self.layer_attention if self.layer_attention is not None else cfg.layer_attention
            if layers is None:
                raise InvalidArgumentError(HYBRID_NEEDS_LAYERS)
        return dataclasses.replace(self, attention=path, layer_attention=None if layers is None else tuple(layers),
                                   feature_map=feature_map or self.feature_map)

    def for_request(self, cfg: ModelConfig, attention: str | None = None, softmax_layers=None,
                    window: int | None = None, sparse_keys: int | None = None) -> "RunSpec":
        """This spec with a request's attention options resolved against `cfg` (the checkpoint's config)
        exactly as `resolve` does for the CLI: none given, this spec unchanged; `sparse_keys` alone, this
        spec's mode with that many sparse keys (it needs linear layers with a window)."""
        if attention is None and softmax_layers is None and window is None:
            if sparse_keys is None:
                return self
            mode = self.run_config(cfg)
            return dataclasses.replace(self, **resolve_mode(mode, None, None, None, sparse_keys))
        return dataclasses.replace(self, **resolve_mode(cfg, attention, softmax_layers, window, sparse_keys))

    def layer_paths(self, num_layers: int) -> tuple[str, ...]:
        """Per layer "softmax" or "linear" (a window does not change a layer's path)."""
        return self.layer_attention if self.attention == "hybrid" else (self.attention,) * num_layers

    def run_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this run's attention, layers and window (for formulas that read a config)."""
        return cfg.replace(attention=self.attention, layer_attention=self.layer_attention, window=self.linear_window,
                           sparse_keys=self.linear_sparse_keys)

    @property
    def linear_window(self) -> int:
        """The window the linear layers run with (0: none, and always 0 on the softmax path)."""
        return self.window if self.attention != "softmax" else 0

    @property
    def linear_sparse_keys(self) -> int:
        """The sparse keys the linear layers keep (0 without a linear window, where there is nothing to keep)."""
        return self.sparse_keys if self.linear_window else 0

    @property
    def mode(self) -> tuple:
        """What decides the arithmetic of a sequence's attention (a batch holds one mode)."""
        return (self.attention, self.layer_attention, self.window, self.sparse_keys, self.feature_map, self.map_set)

    def describe(self) -> str:
        out = self.attention
        if self.attention == "hybrid":
            out += f" (softmax layers {','.join(str(i) for i, p in enumerate(self.layer_attention) if p == 'softmax')})"
        out += f" + window {self.window}" if self.window else ""
        return out + (f" + {self.linear_sparse_keys} sparse keys" if self.linear_sparse_keys else "")


def map_set_for(attention: str, window: int) -> str | None:
    """Which set of learned maps a run asks for (`models.linearized.VARIANTS`): "no_window" when its
    linear layers run without a window (all linear, or a hybrid without one), else None (the default)."""
    return NO_WINDOW if attention in ("linear", "hybrid") and not window else None


def check_sparse_keys(sparse_keys) -> int | None:
    """None (the config's) or an integer >= 0: the hard keys each linear layer and head keeps exact."""
    if sparse_keys is not None and (isinstance(sparse_keys, bool) or not isinstance(sparse_keys, int) or sparse_keys < 0):
        raise WindowError(f"--sparse-keys must be an integer >= 0 (the keys each linear layer keeps exact past its "
                          f"window; 0: none), got {sparse_keys!r}")
    return sparse_keys


def resolve_mode(cfg: ModelConfig, attention=None, softmax_layers=None, window=None, sparse_keys=None) -> dict:
    """The attention fields of a RunSpec (attention, layer_attention, window, sparse_keys, map_set) for the
    options. The sparse cache (`sparse_keys`) runs on linear layers with a window: the config's own with
    its mode, else 0 unless given."""
    check_window(window)
    check_sparse_keys(sparse_keys)
    if attention is None and softmax_layers is None and window is None:
        out = mode_fields(cfg.attention, cfg.layer_attention, cfg.window,
                          cfg.sparse_keys if sparse_keys is None else sparse_keys)
    else:
        out = mode_fields(**_explicit_mode(cfg, attention, softmax_layers, window), sparse_keys=sparse_keys or 0)
    if sparse_keys and not (out["window"] and out["attention"] != "softmax"):
        lacks = ("no linear layers (use --attention linear or hybrid with --window W)" if out["attention"] == "softmax"
                 else "no window (add --window W)")
        raise WindowError(f"--sparse-keys {sparse_keys} keeps hard keys exact past a linear layer's window; this run "
                          f"has {lacks}")
    return out


def _explicit_mode(cfg: ModelConfig, attention, softmax_layers, window) -> dict:
    path = check_attention(attention if attention is not None else
                           "hybrid" if softmax_layers is not None else cfg.attention)
    if softmax_layers is not None and path != "hybrid":
        raise InvalidArgumentError(f"--softmax-layers needs --attention hybrid (got {path})")
    if path == "softmax":
        if window is not None:
            raise WindowError("--window applies to linear layers; softmax attention has none")
        return {"attention": "softmax", "layer_attention": None, "window": 0}
    if path == "linear":
        return {"attention": "linear", "layer_attention": None, "window": window or 0}
    if softmax_layers is None:
        if cfg.layer_attention is None:
            raise InvalidArgumentError(HYBRID_NEEDS_LAYERS)
        layers = cfg.layer_attention
    else:
        layers = parse_softmax_layers(softmax_layers, cfg)
    return {"attention": "hybrid", "layer_attention": layers, "window": window or 0}


def mode_fields(attention: str, layer_attention, window: int, sparse_keys: int = 0) -> dict:
    window = window if attention != "softmax" else 0
    return {"attention": attention, "layer_attention": None if layer_attention is None else tuple(layer_attention),
            "window": window, "sparse_keys": sparse_keys if window else 0, "map_set": map_set_for(attention, window)}


__all__ = ["RunSpec", "resolve_mode", "map_set_for", "check_attention", "check_window",
           "check_sparse_keys", "check_threads", "check_backend", "check_activations", "check_quantize", "check_prefill_chunk",
           "parse_dtype", "parse_device", "parse_softmax_layers", "layer_attention_for", "highest_loss_layers",
           "UnknownAttentionError", "WindowError", "ThreadsError", "BACKENDS", "ACTIVATIONS",
           "QUANT_KINDS", "DEFAULT_PREFILL_CHUNK", "NATIVE_PREFILL_CHUNK", "MODULE_PREFILL_CHUNK", "DEFAULT_ACTIVATIONS", "DTYPES", "NO_WINDOW"]
