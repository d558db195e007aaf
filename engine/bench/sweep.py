"""The sweep: for each (attention, context) prefill to that depth, then time decode steps.

One configuration = one fresh state sized to the depth: the KV cache holds exactly
context + warmup + steps slots. The prompt is `context` random token ids (seeded), run as
one prefill block with logits for its last position only (with `prefill_tokens` P < context:
P of them, then the state is brought to the depth by repeating the P cached keys/values,
`engine.bench.depth`; decode time depends on the depth, not the values); then `warmup` untimed decode
steps, then `steps` timed ones, each a `model.step` on one token plus the greedy argmax
that picks the next (EOS ignored: runs have a fixed length). Python's GC is off while timing.

By default each configuration runs in a fresh subprocess (`engine.bench.worker`), so its
peak resident set (VmHWM) is its own: the model, one state, one prefill.
"""
from __future__ import annotations

import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.attention import get_feature_map
from engine.attention.sparse import BLOCK
from engine.bench.configs import check_entries, configure, entry_window, layer_paths, parse_attentions
from engine.bench.depth import extend_to_depth
from engine.bench.floor import weight_bytes_read
from engine.bench.memory import config_state_bytes, peak_rss_bytes
from engine.errors import EngineError, InvalidArgumentError
from engine.loader import parse_dtype
from engine.quant import weights_label
from engine.steps import Stepper, check_backend
from engine.steps.native import weights_read

DEFAULT_CONTEXTS = (128, 512, 2048, 8192, 32768)
INTERRUPTED = 130   # a worker's exit code after Ctrl-C (engine.bench.worker)
# --weights: (dtype the model loads in, block quantization applied at load)
WEIGHTS = {"f32": ("float32", None), "f16": ("float16", None), "bf16": ("bfloat16", None),
           "q8_0": ("float32", "q8_0"), "q4_0": ("float32", "q4_0"), "q4_1": ("float32", "q4_1")}


class BenchError(EngineError, RuntimeError):
    """A benchmark configuration failed (the worker's own error is quoted)."""


@dataclass(frozen=True)
class BenchSettings:
    model: str = "tiny"
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    attentions: tuple[str, ...] = ("softmax", "linear")
    feature_map: str | None = None      # linear path; None: the model config's
    steps: int = 64                     # timed decode steps per configuration
    warmup: int = 8                     # untimed decode steps before them
    threads: int | None = None          # CPU threads; None: engine.threads.default_threads()
    dtype: str = "float32"
    kv_dtype: str | None = None         # the KV cache's dtype; None: the model's
    device: str = "cpu"
    isolate: bool = True                # a fresh subprocess per configuration
    backend: str = "auto"               # the decode step form (engine.steps): auto, torch, native, module
    native: bool = False                # alias of backend="native"
    weights: str | None = None          # f32 | f16 | bf16 (sets dtype) | q8_0 | q4_0 | q4_1 (fp32, quantized)
    batch: int = 1                      # sequences decoded together; tokens/s is their aggregate
    seed: int = 0
    softmax_layers: str | None = None   # hybrid entries: "2,9,11" or "auto:K"; None: the config's layer_attention
    window: int | None = None           # window entries (and linear/hybrid ones when no window entry is listed)
    sparse_keys: int | None = None      # entries whose linear layers have a window: M hard keys kept exact
    prefill_tokens: int | None = None   # real tokens prefilled per depth (the rest repeated); None: the whole depth
    contexts_sorted: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        ctx = tuple(int(c) for c in self.contexts)
        if not ctx or any(c < 1 for c in ctx):
            raise InvalidArgumentError(f"contexts must be positive integers, got {self.contexts!r}")
        object.__setattr__(self, "attentions", parse_attentions(self.attentions))
        if self.softmax_layers is not None and not isinstance(self.softmax_layers, str):
            object.__setattr__(self, "softmax_layers", ",".join(str(i) for i in self.softmax_layers))
        check_entries(self.attentions, self.softmax_layers, self.window, self.sparse_keys)
        if self.prefill_tokens is not None and (isinstance(self.prefill_tokens, bool) or self.prefill_tokens < 1):
            raise InvalidArgumentError(f"prefill_tokens must be >= 1, got {self.prefill_tokens!r}")
        if self.feature_map is not None:
            get_feature_map(self.feature_map)
        if self.steps < 1 or self.warmup < 0:
            raise InvalidArgumentError(f"steps must be >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, got {self.threads}")
        if self.native:
            object.__setattr__(self, "backend", "native")
        check_backend(self.backend)
        if self.weights is not None:
            if self.weights not in WEIGHTS:
                raise InvalidArgumentError(f"unknown weights {self.weights!r}; valid: {', '.join(WEIGHTS)}")
            object.__setattr__(self, "dtype", WEIGHTS[self.weights][0])
        if self.batch < 1:
            raise InvalidArgumentError(f"batch must be >= 1, got {self.batch}")
        parse_dtype(self.kv_dtype)
        object.__setattr__(self, "contexts", ctx)
        object.__setattr__(self, "contexts_sorted", tuple(sorted(set(ctx))))

    def configurations(self) -> list[tuple[str, int]]:
        """(attention, context) in the order they run: context-major, shallow first."""
        return [(a, c) for c in self.contexts_sorted for a in self.attentions]

    @property
    def quantize(self) -> str | None:
        return WEIGHTS[self.weights][1] if self.weights else None

    def slots(self, context: int) -> int:
        return context + self.warmup + self.steps

    def prefilled(self, context: int) -> int:
        """Real tokens prefilled for a depth (the rest of it repeated, `engine.bench.depth`)."""
        return context if self.prefill_tokens is None else min(context, self.prefill_tokens)

    def window_for(self, entry: str) -> int | None:
        return entry_window(entry, self.attentions, self.window)

    def preset(self, cfg, entry: str):
        """(RunSpec, record keys) of one entry on the checkpoint's config: the entry's preset
        (engine.bench.configs.preset) with this run's feature map, dtypes, device, backend, threads and
        quantization."""
        return configure(cfg, entry, self.softmax_layers if entry == "hybrid" else None, self.window_for(entry),
                         **self.run_options())

    def run_options(self) -> dict:
        """What every entry's RunSpec takes from these settings besides its attention."""
        return {"feature_map": self.feature_map, "dtype": self.dtype, "kv_dtype": self.kv_dtype,
                "device": self.device, "backend": self.backend, "threads": self.threads, "quantize": self.quantize,
                "sparse_keys": self.sparse_keys}

    def runtime(self, cfg, entry: str):
        """(runtime config, record keys) of one entry on the checkpoint's config (its preset's config)."""
        spec, keys = self.preset(cfg, entry)
        return spec.run_config(cfg), keys

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("contexts_sorted")
        d["contexts"] = list(self.contexts_sorted)
        d["attentions"] = list(self.attentions)
        return d


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    k = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[k - 1]


def _next_token(logits: torch.Tensor) -> torch.Tensor:   # (B, 1, V) -> (B, 1)
    return logits[:, -1].argmax(-1, keepdim=True)


def _clock(device: torch.device) -> float:
    """perf_counter after the device has finished its queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def window_span(run) -> int:
    """Real tokens a run's window state needs before it holds all it will hold (its W + 63 recent keys and
    M cached ones, the cache's decisions every BLOCK tokens): `--prefill-tokens` below that timed a state
    whose sparse cache was empty (no cached key read) and whose window held unwritten keys."""
    if not run.linear_window:
        return 0
    return run.linear_window + run.linear_sparse_keys + 2 * BLOCK


def measure(model, attention: str, context: int, steps: int, warmup: int,
            feature_map: str | None = None, seed: int = 0, backend: str = "auto", batch: int = 1,
            prefill_tokens: int | None = None, spec=None, threads: int | None = None) -> dict:
    """Prefill `context` tokens, then time `steps` decode steps (after `warmup`). In-process.

    attention: the path to run on the model's default run; spec: the run itself (a RunSpec: hybrid
    layers, a window; `measure_entry` makes it from the entry). threads: the native pool's (None: default). prefill_tokens P < context: prefill P tokens, then repeat
    their keys/values up to the depth (`engine.bench.depth`); prefill_s times the P tokens. A run with a
    window prefills at least `window_span` real tokens (its window and sparse cache full, as at depth).

    The steps run through a `Stepper` for `backend`; the record names the form that ran them.
    batch > 1: that many sequences (different random prompts) step together; decode_tokens_per_s
    is their aggregate (batch / seconds per step), decode_ms_per_token the time of one step: each
    sequence's time per token (vLLM's TPOT), not the step's time over the batch.
    """
    cfg = model.config
    run = model.run_spec(attention, feature_map, spec)
    attention = run.attention
    step = Stepper(model, backend, threads=threads)
    slots = context + warmup + steps
    if model.rotary is not None:   # grow the rotary table once, outside every timing
        model.rotary.table(slots, model.device, model.dtype)
    real = context if prefill_tokens is None else min(context, max(prefill_tokens, window_span(run)))
    prompt = torch.randint(0, cfg.vocab_size, (batch, real), generator=torch.Generator().manual_seed(seed))
    scratch = model.init_state(batch, max_len=16 + warmup, spec=run)
    tok = _next_token(step(prompt[:, :16].to(model.device), scratch, last_only=True))   # warm the kernels
    for _ in range(warmup):
        tok = _next_token(step(tok, scratch))
    del scratch

    state = model.init_state(batch, max_len=slots, spec=run)
    gc.collect()
    gc.disable()
    dev = model.device
    prompt = prompt.to(dev)
    try:
        t0 = _clock(dev)
        tok = _next_token(step(prompt, state, last_only=True))
        prefill_s = _clock(dev) - t0
        if real < context:
            t0 = _clock(dev)
            extend_to_depth(state, context)
            fill_s = _clock(dev) - t0
        for _ in range(warmup):
            tok = _next_token(step(tok, state))
        times = []
        for _ in range(steps):
            t0 = _clock(dev)
            tok = _next_token(step(tok, state))
            times.append(_clock(dev) - t0)
    finally:
        gc.enable()
    times.sort()
    median = statistics.median(times)
    fmap = run.feature_map if attention != "softmax" else None
    rt = run.run_config(cfg)
    return {
        "attention": attention, "feature_map": fmap, "context": context,
        "state_slots": slots if "softmax" in layer_paths(rt) else None,
        "decode_depths": [context, slots - 1],
        "batch": batch, "prefill_s": prefill_s, "prefill_tokens_per_s": batch * real / prefill_s,
        "prefill_tokens": real, "depth_fill": "prefill" if real == context else "repeat",
        "depth_fill_s": fill_s if real < context else 0.0,
        "decode_ms_per_token": median * 1e3, "decode_ms_per_token_p90": percentile(times, 90) * 1e3,
        "decode_ms_per_token_min": times[0] * 1e3, "decode_tokens_per_s": batch / median,
        "state_bytes": state.nbytes,
        "state_bytes_formula": config_state_bytes(rt, slots, model.dtype, fmap, batch, run.kv_dtype),
        # what a step must read (engine.bench.floor): the weights, and the state at the median timed step's depth
        "weight_bytes_read": weight_bytes_read(model, state),
        "state_bytes_read": config_state_bytes(rt, context + warmup + steps // 2, model.dtype, fmap, batch,
                                               run.kv_dtype),
        "kv_dtype": str(run.kv_dtype or model.dtype).removeprefix("torch."),
        "beyond_trained_positions": slots > cfg.max_position_embeddings,
        "steps": steps, "warmup": warmup,
        "step_form": step.last_form, "fallback": step.fallback,
    }


def measure_entry(model, entry: str, context: int, steps: int, warmup: int, feature_map=None, seed: int = 0,
                  backend: str = "auto", batch: int = 1, prefill_tokens=None, softmax_layers=None,
                  window=None, threads: int | None = None, sparse_keys: int | None = None) -> dict:
    """`measure` for one bench entry (softmax, linear, hybrid, window, default): the entry's RunSpec
    preset (engine.bench.configs.preset; the model's config untouched), on `threads` native threads."""
    spec, keys = configure(model.config, entry, softmax_layers, window, feature_map=feature_map,
                           kv_dtype=model.kv_dtype, dtype=model.dtype, device=model.device, backend=backend,
                           threads=threads, sparse_keys=sparse_keys)
    rec = measure(model, spec.attention, context, steps, warmup, feature_map, seed, backend, batch,
                  prefill_tokens, spec=spec, threads=threads)
    rec.update(keys)
    rec["weights_stored"] = weights_label(model)
    if rec["step_form"] == "native":   # fp32 weights of 16-bit values are read from 16-bit copies
        rec["weights_read"] = weights_read(model)
    return rec


def run_in_process(model, settings: BenchSettings, attention: str, context: int) -> dict:
    """attention: one entry of settings.attentions."""
    rec = measure_entry(model, attention, context, settings.steps, settings.warmup, settings.feature_map,
                        settings.seed, settings.backend, settings.batch, settings.prefill_tokens,
                        settings.softmax_layers if attention == "hybrid" else None, settings.window_for(attention),
                        threads=settings.threads, sparse_keys=settings.sparse_keys)
    rec["weights"] = settings.weights or rec["weights_stored"]
    rec["peak_rss_bytes"] = peak_rss_bytes()
    rec["rss_method"] = ("VmHWM of the bench process itself (--no-isolate): the peak over everything "
                         "run so far, not this configuration alone")
    return rec


def run_isolated(model_path: str, settings: BenchSettings, attention: str, context: int) -> dict:
    """Run one configuration in a fresh `python -m engine.bench.worker`; returns its record."""
    job = {"model": model_path, "dtype": settings.dtype, "kv_dtype": settings.kv_dtype, "device": settings.device,
           "threads": settings.threads,
           "attention": attention, "context": context, "steps": settings.steps, "warmup": settings.warmup,
           "feature_map": settings.feature_map, "seed": settings.seed, "backend": settings.backend,
           "quantize": settings.quantize, "batch": settings.batch, "prefill_tokens": settings.prefill_tokens,
           "softmax_layers": settings.softmax_layers if attention == "hybrid" else None,
           "window": settings.window_for(attention), "sparse_keys": settings.sparse_keys}
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "engine.bench.worker"], input=json.dumps(job),
                          capture_output=True, text=True, env=env)
    if proc.returncode in (INTERRUPTED, -signal.SIGINT):   # Ctrl-C reached the worker alone
        raise KeyboardInterrupt
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"{attention} at context {context}: worker exited with code {proc.returncode}: {tail}")
    rec = json.loads(lines[-1])
    rec["weights"] = settings.weights or rec["weights_stored"]
    return rec
