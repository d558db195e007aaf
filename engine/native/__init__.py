"""An optional native decode step (engine/native/decode.c): batch 1, fp32, CPU, either path.

    model.native_decode = True        # or load(..., native=True), gen --native, gen bench --native

With it, `Transformer.step` runs a one-token step of an unpadded batch-1 fp32 CPU state (a KV
cache, or a linear state with any of the four feature maps) in C instead of ~125 PyTorch calls;
every other case takes the PyTorch path as before. The C code reads the model's weight tensors
and writes the state's own tensors in place through their data pointers, so prefill (PyTorch)
and decode (C) share one state. It is compiled on first use
with the system C compiler ($CC, else cc) into ~/.cache/gen-engine (or $GEN_ENGINE_CACHE),
keyed by the source's hash; without a compiler, NativeUnavailableError says so.
tests/test_native.py holds it to the PyTorch step.
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

from engine.attention.linear import EPS
from engine.errors import EngineError

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


def applies(model, state, tokens) -> bool:
    """The cases the C step covers; the caller falls back to PyTorch for all others."""
    if tokens.shape != (1, 1) or state.padded or tokens.device.type != "cpu":
        return False
    if model.embed_tokens.weight.dtype != torch.float32:
        return False
    if state.path == "softmax":
        return state.k.dtype == torch.float32
    return state.S.dtype == torch.float32 and state.feature_map.name in MODES


def _ptr(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), _P)


class NativeDecoder:
    """The Plan for one (model, state) pair: weight and cache pointers, scratch, made once."""

    def __init__(self, model, state):
        from models.decode import _EPOCH, layer_weights
        self.library = library()
        cfg = model.config
        self.model, self.epoch = model, _EPOCH
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

    def valid_for(self, model) -> bool:
        from models.decode import _EPOCH
        return self.model is model and self.epoch == _EPOCH

    def step(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (1, 1) -> logits (1, 1, V); writes one cache slot and advances the state."""
        block = state.begin(tokens)          # capacity check (ContextFullError), as the PyTorch path
        pos = block.start
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
        state.end(block)
        return logits
