"""The native step form (decode.c via ctypes): one-token steps in C, either attention path.

    make_step(model, backend="native")      # or load(..., backend="native"), gen --backend native

It runs a one-token step of an unpadded batch-1 fp32 CPU state (a KV cache, or a linear state
with any of the four feature maps) in C instead of ~125 PyTorch calls; `why_not` names every
other case, which the Stepper hands to the torch form. The C code reads the model's weight
tensors and writes the state's own tensors in place through their data pointers, so prefill
(PyTorch) and decode (C) share one state.

Pointers: a `NativeStep` keeps one plan per state it has stepped (a weak map, so a freed state
frees its plan). Before every step it re-checks each weight's storage pointer, dtype and device
against the plan's, and rebuilds the plan when any moved (`model.half().float()` swaps the
storage under the same Parameter objects: stepping on with old pointers would read freed memory).

It is compiled on first use with the system C compiler ($CC, else cc) into ~/.cache/gen-engine
(or $GEN_ENGINE_CACHE), keyed by the source's hash, the flags and the CPU; without a compiler,
NativeUnavailableError says so. tests/test_native.py holds it to the module path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

import weakref

from engine.attention.linear import EPS
from engine.errors import EngineError
from engine.transformer import layer_weights

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared"]
_P = ctypes.POINTER(ctypes.c_float)
_PP = ctypes.POINTER(_P)
_LIB = None


class NativeUnavailableError(EngineError, RuntimeError):
    """The native decode step cannot be built or does not apply here."""


class Plan(ctypes.Structure):   # field for field the C struct Plan
    _fields_ = ([(n, ctypes.c_int) for n in ("L", "C", "H", "Hkv", "D", "I", "V", "S_max")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(n, _P) for n in ("embed", "norm", "head")]
                + [(n, _PP) for n in ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")]
                + [(n, _P) for n in ("k", "v", "x", "xb", "qkv", "att", "gu", "hb", "scores")]
                + [("mode", ctypes.c_int), ("F", ctypes.c_int), ("lin_eps", ctypes.c_float)]
                + [(n, _P) for n in ("S", "z", "phi_q", "phi_k")])

MODES = {"elu1": 1, "relu": 2, "softmax": 3, "cos1": 4}   # linear feature maps; 0 is softmax attention


def library():
    """The compiled step, built once per source version (cached on disk, then per process)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NativeUnavailableError("the native decode step needs a C compiler (cc or gcc) on PATH; "
                                     "install one or run without --native")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS + [cc, _cpu_id()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("GEN_ENGINE_CACHE") or Path.home() / ".cache" / "gen-engine")
    lib = cache / f"decode-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        r = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            first = (r.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailableError(f"compiling {SOURCE.name} with {cc} failed: {first}")
        os.replace(tmp, lib)   # atomic: a concurrent build never sees half a file
    _LIB = ctypes.CDLL(str(lib))
    _LIB.gen_decode_step.argtypes = [ctypes.POINTER(Plan), ctypes.c_int, ctypes.c_int, _P, _P, _P]
    _LIB.gen_decode_step.restype = None
    return _LIB


def _cpu_id() -> str:
    """What -march=native compiled for: a library built on another CPU is not reused."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def why_not(model, state, tokens) -> str | None:
    """None for the cases the C step covers; otherwise the reason (the caller falls back)."""
    if tokens.device.type != "cpu":
        return f"the native step runs on the CPU, not {tokens.device.type}"
    if tokens.shape != (1, 1):
        return f"the native step runs batch 1, not batch {tokens.shape[0]}"
    if state.padded:
        return "the native step does not run padded states"
    if model.embed_tokens.weight.dtype != torch.float32:
        return f"the native step needs fp32 weights, not {str(model.embed_tokens.weight.dtype).removeprefix('torch.')}"
    tensors = state.tensors()
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return "the native step needs a contiguous fp32 state"
    if state.path == "linear" and state.feature_map.name not in MODES:
        return f"the native step has no feature map {state.feature_map.name!r}"
    return None


class NativeStep:
    """The native form: `why_not(state, tokens)`, then `step(tokens, state)` via `__call__`."""
    name = "native"

    def __init__(self, model, threads: int | None = None):
        self.library = library()          # raises NativeUnavailableError without a compiler
        self.model, self.threads = model, threads
        self.plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # state -> NativeDecoder

    def why_not(self, state, tokens) -> str | None:
        return why_not(self.model, state, tokens)

    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor:
        plan = self.plans.get(state)
        if plan is None or not plan.still_valid(state):
            plan = self.plans[state] = NativeDecoder(self.model, state)
        return plan.step(tokens, state)


def _ptr(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), _P)


class NativeDecoder:
    """The Plan for one (model, state) pair: weight and cache pointers, scratch, made once."""

    def __init__(self, model, state):
        self.library = library()
        cfg = model.config
        self.model, self.epoch = model, model.weights_epoch
        weights = layer_weights(model)
        flat = [w for layer in weights for w in layer] + [model.embed_tokens.weight, model.norm.weight,
                                                          model.lm_head.weight]
        if not all(w.is_contiguous() and w.dtype == torch.float32 and w.device.type == "cpu" for w in flat):
            raise NativeUnavailableError("the native decode step needs contiguous fp32 CPU weights")
        tensors = state.tensors()   # [k, v] or [S, z]
        if not all(t.is_contiguous() for t in tensors):
            raise NativeUnavailableError("the native decode step needs a contiguous state")
        H, Hkv, D, I, C = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.hidden_size)
        linear = state.path == "linear"
        F_ = state.feature_map.out_dim(D) if linear else 0
        self.scratch = {n: torch.zeros(size) for n, size in
                        (("x", C), ("xb", C), ("qkv", (H + 2 * Hkv) * D), ("att", H * D), ("gu", 2 * I),
                         ("hb", I), ("scores", 1 if linear else state.max_len), ("phi_q", max(F_, 1)),
                         ("phi_k", max(F_, 1)))}
        self.tables = {n: (_P * cfg.num_hidden_layers)(*[_ptr(layer[i]) for layer in weights])
                       for i, n in enumerate(("ln1", "wqkv", "wo", "ln2", "wgu", "wd"))}
        self.keep = (flat, tensors)   # the pointers stay valid while these live
        self.flat, self.tensors = flat, tensors
        self.pointers = self._pointers()
        state_ptrs = dict(S=_ptr(state.S), z=_ptr(state.z)) if linear else dict(k=_ptr(state.k), v=_ptr(state.v))
        self.plan = Plan(L=cfg.num_hidden_layers, C=C, H=H, Hkv=Hkv, D=D, I=I, V=cfg.vocab_size,
                         S_max=0 if linear else state.max_len, eps=cfg.rms_norm_eps, scale=D ** -0.5,
                         embed=_ptr(model.embed_tokens.weight), norm=_ptr(model.norm.weight),
                         head=_ptr(model.lm_head.weight), mode=MODES[state.feature_map.name] if linear else 0,
                         F=F_, lin_eps=EPS, **state_ptrs, **self.tables,
                         **{n: _ptr(t) for n, t in self.scratch.items()})
        self.plan_ref = ctypes.byref(self.plan)
        self.rope = model.uses_rope(state.path)
        self.V, self.D = cfg.vocab_size, D

    def _pointers(self) -> list:
        """(storage pointer, dtype, device) of every weight and state tensor the plan points into."""
        return [(t.data_ptr(), t.dtype, t.device) for t in self.flat + self.tensors]

    def still_valid(self, state) -> bool:
        """The plan's pointers are still the tensors' own (checked before every step)."""
        if self.epoch != self.model.weights_epoch:
            return False   # .to()/load_state_dict: Parameter objects or their storage were replaced
        return self._pointers() == self.pointers and state.tensors()[0] is self.tensors[0]

    def step(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (1, 1) -> logits (1, 1, V); writes one cache slot and advances the state."""
        span = state.open(tokens)            # capacity check (ContextFullError), as the PyTorch path
        pos = span.start
        token = int(tokens[0, 0])
        if not 0 <= token < self.V:
            raise IndexError(f"token id {token} outside the vocabulary (0..{self.V - 1})")
        cos = sin = None
        if self.rope:
            c, s = self.model.rotary.table(pos + 1, tokens.device, torch.float32)
            cos = ctypes.cast(c.data_ptr() + pos * self.D * 4, _P)
            sin = ctypes.cast(s.data_ptr() + pos * self.D * 4, _P)
        logits = torch.empty(1, 1, self.V)
        self.library.gen_decode_step(self.plan_ref, token, pos, cos, sin, _ptr(logits))
        state.commit(span)
        return logits
