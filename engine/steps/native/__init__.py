"""The native step form (C via ctypes): one-token steps of a batch in C, either attention path.

    make_step(model, backend="native")      # or load(..., backend="native"), gen --backend native

It runs the one-token step of a CPU state (a KV cache; a linear state with any of the four fixed
feature maps or learned hedgehog maps; a sliding window + linear state; a hybrid of a KV cache and
one of those, per layer) of a Llama-shaped model (Llama, Mistral, Qwen2's q/k/v biases, Qwen3's
per-head q/k norms), any batch size, left-padded rows included, on weights in fp32, f16, bf16 or
quantized blocks (engine.quant: q8_0, q4_0, q4_1, a GGUF file's q4_k, q5_k, q6_k, and stacks of
them), on `threads` threads (engine.threads); `why_not` names every other case and the Stepper hands it to the torch form. The C code reads the model's
weight tensors and writes the state's own tensors in place through their data pointers, so a
prefill on either side and decode share one state (`prefill` runs prompt blocks on the pool too).
fp32 weights that hold only 16-bit values (a checkpoint stored in f16 or bf16, loaded in fp32) are
read from f16 / bf16 copies made once (`_exact16`): the same fp32 products from half the bytes.
Compute is fp32 (16-bit weights widened), except quantized matrices: there each matmul rounds its
activations to q8 blocks and takes one int8 dot per block, as llama.cpp does (qdot.c;
engine.quant.linear_q8 is the PyTorch twin the tests hold it to).

Pointers: a `NativeStep` keeps one plan per state it has stepped (a weak map, so a freed state
frees its plan). Before every step it re-checks each weight's storage pointer, dtype and device
against the plan's, and rebuilds the plan when any moved (`model.half().float()` swaps the
storage under the same Parameter objects: stepping on with old pointers would read freed memory).
A plan is freed only after the thread pool has no worker left inside one of its chunks.

Built on first use (engine.steps.native.build); tests/test_native.py holds it to the module path.
"""
from __future__ import annotations

import ctypes
import operator
import weakref

import torch

from engine.attention.linear import EPS
from engine.quant import QuantLinear, QuantStack, weights_label
from engine.steps.native.build import NativeUnavailableError, library
from engine.runspec import ACTIVATIONS, check_activations  # noqa: F401 (re-exported)
from engine.threads import default_threads

__all__ = ["NativeStep", "NativeDecoder", "NativeUnavailableError", "library", "pool_adapt", "pool_stats",
           "set_parallel_min", "PARALLEL_MIN_MACS", "weights_read", "why_not"]

_P = ctypes.POINTER(ctypes.c_float)
_V = ctypes.c_void_p
TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, "q8_0": 3, "q4_0": 4, "q4_1": 5,
         "q4_k": 8, "q5_k": 9, "q6_k": 10}
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
MODES = {"elu1": 1, "relu": 2, "softmax": 3, "cos1": 4, "hedgehog": 5}   # linear feature maps; 0 is softmax attention
HEDGEHOG_MAX_D = 256   # gen.h
PREFILL_ROWS = 64   # a prompt block runs this many tokens at a time (the rows of one batched step)


class Mat(ctypes.Structure):   # gen.h Mat
    pass


Mat._fields_ = [("data", _V), ("type", ctypes.c_int), ("rows", ctypes.c_int), ("cols", ctypes.c_int),
                ("split", ctypes.c_int), ("rest", ctypes.POINTER(Mat))]


def _mat(m: tuple, keep: list) -> Mat:
    """The gen.h Mat of a `_matrix` tuple; a QuantStack's (5 items) chains its segments through
    Mat.rest (the chained Mats go to `keep`, which must live as long as the Mat is used)."""
    base = m[0].data_ptr()
    if len(m) == 4:
        return Mat(base, m[1], m[2], m[3])
    mats = [Mat(base + off, t, rows, m[3]) for off, t, rows in m[4]]
    for i in range(len(mats) - 2, -1, -1):   # each segment's rows = its own and those after it
        mats[i].split, mats[i].rows = mats[i].rows, mats[i].rows + mats[i + 1].rows
        mats[i].rest = ctypes.pointer(mats[i + 1])
    keep.append(mats)
    return mats[0]


class Plan(ctypes.Structure):   # gen.h Plan, field for field
    _fields_ = ([(n, ctypes.c_int) for n in ("L", "C", "H", "Hkv", "D", "I", "V", "B", "S_max")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("embed", Mat), ("head", Mat),
                   ("norm", _V), ("norm_type", ctypes.c_int)]
                + [(n, ctypes.POINTER(Mat)) for n in ("qkv", "wo", "gu", "wd")]
                + [(n, ctypes.POINTER(_V)) for n in ("ln1", "ln2")]
                + [("k", _V), ("v", _V), ("kv_type", ctypes.c_int), ("mode", ctypes.c_int), ("F", ctypes.c_int),
                   ("lin_eps", ctypes.c_float)]
                + [(n, _P) for n in ("S", "z", "x", "xb", "qkv_out", "att", "gu_out", "hb")]
                + [("nthreads", ctypes.c_int), ("tscratch", _P), ("tscratch_floats", ctypes.c_size_t)]
                + [("Bc", ctypes.c_int), ("seq", ctypes.c_int)]
                + [(n, _V) for n in ("hq_w", "hq_b", "hk_w", "hk_b")] + [("hh_type", ctypes.c_int)]
                + [(n, ctypes.POINTER(ctypes.c_int)) for n in ("layer_mode", "layer_index")]
                + [("linear_rope", ctypes.c_int)]
                + [("wk", _V), ("wv", _V), ("wreal", _V), ("W", ctypes.c_int), ("w_type", ctypes.c_int)]
                + [("hh_decay", _P), ("hh_logit", _P), ("hh_gate", _P)]
                + [("q8_acts", ctypes.c_int)]
                + [("qkv_bias", ctypes.POINTER(_P)), ("q_norm", ctypes.POINTER(_V)), ("k_norm", ctypes.POINTER(_V))])


def _bind(lib):
    if not getattr(lib, "_gen_bound", False):
        lib.gen_plan_init.argtypes = [ctypes.POINTER(Plan)]
        lib.gen_plan_init.restype = ctypes.c_int
        lib.gen_plan_free.argtypes = [ctypes.POINTER(Plan)]
        lib.gen_plan_free.restype = None
        lib.gen_decode_step.argtypes = [ctypes.POINTER(Plan), _V, ctypes.c_int, _V, _V, ctypes.c_int, _V, _V]
        lib.gen_decode_step.restype = None
        lib.gen_prefill_block.argtypes = [ctypes.POINTER(Plan), ctypes.c_int, ctypes.c_int, _V, ctypes.c_int, _V, _V,
                                          _V, _V]
        lib.gen_prefill_block.restype = None
        lib.gen_set_parallel_min.argtypes = [ctypes.c_longlong]
        lib.gen_set_parallel_min.restype = None
        lib.gen_pool_adapt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong]
        lib.gen_pool_adapt.restype = None
        lib.gen_pool_rest.argtypes = []
        lib.gen_pool_rest.restype = None
        lib.gen_pool_spin.argtypes = [ctypes.c_longlong]
        lib.gen_pool_spin.restype = None
        lib.gen_pool_workers.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.gen_pool_workers.restype = None
        lib.gen_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
        lib.gen_pool_stats.restype = None
        lib.gen_has_q4_1r.argtypes = []
        lib.gen_has_q4_1r.restype = ctypes.c_int
        lib._gen_bound = True
    return lib


PARALLEL_MIN_MACS = 65536   # decode.c's gen_par_min_macs, the default


def set_parallel_min(macs: int) -> None:
    """Phases below `macs` multiply-adds run on the calling thread alone (tests: 0 puts every phase
    on the pool, so small models exercise it; PARALLEL_MIN_MACS is the default)."""
    _bind(library()).gen_set_parallel_min(macs)


POOL_ADAPT = (0, 115, 2_000_000)   # pool.c's defaults: phases per verdict (0: adaptive mode off), min speedup (%), solo ns


def pool_adapt(window: int = POOL_ADAPT[0], min_speedup_pct: int = POOL_ADAPT[1], solo_ns: int = POOL_ADAPT[2]) -> None:
    """How the pool decides that its workers do not pay (a core taken by another process) and runs
    phases on the caller alone for a while (pool.c): a verdict every `window` phases (0: never solo),
    solo when the phases ran less than `min_speedup_pct`/100 times faster than the caller alone would,
    for `solo_ns` (doubling on each failed probe, up to 16x). No arguments: the defaults."""
    _bind(library()).gen_pool_adapt(window, min_speedup_pct, solo_ns)


def pool_rest() -> None:
    """Let the pool's idle workers sleep now rather than spin (~2 ms) waiting for the next phase:
    for a caller about to spend a while outside the step, e.g. a server delivering a step's tokens
    while other threads (its event loop, clients) need the cores. The next phase wakes them."""
    _bind(library()).gen_pool_rest()


def pool_spin(ns: int = -1) -> None:
    """How long an idle worker spins before it sleeps, in ns (tests; -1: the default, 2 ms)."""
    _bind(library()).gen_pool_spin(ns)


def pool_workers() -> tuple[int, int]:
    """(the pool's worker threads, how many of them sleep right now)."""
    out = (ctypes.c_int * 2)()
    _bind(library()).gen_pool_workers(out)
    return out[0], out[1]


def pool_stats(reset: bool = False) -> dict:
    """The pool's counters since the last reset: phases run parallel and solo, verdicts, failed
    verdicts, and the scored phases' estimated time alone and wall time (ns); the parallel phases'
    chunks, those the caller ran (its own and stolen), those it stole from a late worker, its time
    waiting for the workers after its last own chunk, and the phases' wall time (ns)."""
    out = (ctypes.c_longlong * 11)()
    _bind(library()).gen_pool_stats(out, int(reset))
    keys = ("parallel_phases", "solo_phases", "verdicts", "solo_verdicts", "alone_ns", "wall_ns",
            "chunks", "caller_chunks", "stolen_chunks", "caller_wait_ns", "phase_ns")
    return dict(zip(keys, out))


def _layer_modules(model, paths) -> list[tuple]:
    """Per layer: (ln1 weight, qkv, o_proj, ln2 weight, gate_up, down_proj) -- Linear or QuantLinear;
    a linear layer's adapted projections where the model carries them."""
    return [(b.input_layernorm.weight, *b.self_attn.projections(p != "softmax"), b.post_attention_layernorm.weight,
             b.mlp.gate_up, b.mlp.down_proj) for b, p in zip(model.layers, paths)]


def _matrix(module) -> tuple:
    """(tensor the C code reads, type code, rows, cols) of a Linear, QuantLinear or Embedding; a
    QuantStack's adds its segments, (byte offset in its blocks, type code, rows) each."""
    if isinstance(module, QuantStack):
        segs, at = [], 0
        for kind, rows, b in module.segments():
            segs.append((at, TYPES[kind], rows))
            at += b.numel()
        return module.blocks, segs[0][1], module.out_features, module.in_features, segs
    if isinstance(module, QuantLinear):
        return module.blocks, TYPES[module.kind], module.out_features, module.in_features
    w = module.weight
    return w, TYPES.get(w.dtype, -1), w.shape[0], w.shape[1]


EXACT16 = True   # fp32 weights that are exactly 16-bit values run from a 16-bit copy (tests turn it off)
REGROUP = True        # q4_1 / q8_0 blocks run regrouped where the build has those kernels (tests turn it off)
T_Q4_1R, T_Q8_0R = 6, 7   # gen.h


def _derived(model, w: torch.Tensor, tag: str, make) -> torch.Tensor | None:
    """make(w) (a tensor, or None: nothing to derive), made once per (tensor, storage, version) and
    kept on the model; the cache holds no strong reference to `w`. A tensor changed in place moves
    its version, which the plan checks before every step."""
    cache = model.__dict__.setdefault("_native_derived", {})
    key = (tag, id(w))
    hit = cache.get(key)
    if hit is not None and hit[0]() is w and hit[1] == (w.data_ptr(), w._version):
        return hit[2]
    with torch.no_grad():
        out = make(w)
    cache[key] = (weakref.ref(w), (w.data_ptr(), w._version), out)
    return out


def _exact16(model, w: torch.Tensor) -> torch.Tensor:
    """An f16 (else bf16) copy of an fp32 CPU weight whose every value it holds exactly, else `w`.

    Widening f16 or bf16 to fp32 is exact, so the C step computes the same fp32 products from half
    the bytes: a checkpoint stored in 16 bits and loaded in fp32 (tiny: f16; most Hugging Face
    checkpoints: bf16) decodes bit-identically, reading half the memory per token."""
    if not EXACT16 or w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
        return w

    def narrow(w):
        for dtype in (torch.float16, torch.bfloat16):
            c = w.to(dtype)
            if torch.equal(c.float(), w):
                return c
        return None
    copy = _derived(model, w, "exact16", narrow)
    return w if copy is None else copy


def _regrouped(model, blocks: torch.Tensor, rows: int, q4_1: bool) -> torch.Tensor:
    """Blocks regrouped per row for the C step's grouped kernels (gen.h T_Q4_1R / T_Q8_0R): q4_1
    (20 bytes: f16 d, f16 m, 16 nibble bytes) as every (d, m) pair, then every nibble block; q8_0
    (34 bytes: f16 d, 32 int8) as every d, then every block's weights + 128 as u8. The kernels
    read 4 blocks' weights in one or two loads."""
    def regroup(b):
        if q4_1:
            per_row = b.reshape(rows, -1, 20)
            head, body = per_row[:, :, :4], per_row[:, :, 4:]
        else:
            per_row = b.reshape(rows, -1, 34)
            head = per_row[:, :, :2]
            body = (per_row[:, :, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return torch.cat([head.reshape(rows, -1), body.reshape(rows, -1)], 1).contiguous()
    return _derived(model, blocks, "regrouped", regroup)


def weights_read(model) -> str:
    """What the native step reads for the model's matrices (projections and lm_head), most bytes
    first, as engine.quant.weights_label names them: "float16" for tiny loaded in fp32 (its
    f16 checkpoint's values, read from the exact 16-bit copies), "q4_1+q8_0" for a GGUF's blocks."""
    return weights_label(model, view=lambda w: _exact16(model, w))


def _parts(state) -> tuple:
    """(KV cache part or None, linear or window part or None) of a softmax, linear, window or hybrid state."""
    parts = state.parts if state.path == "hybrid" else [state]
    return (next((p for p in parts if p.path == "softmax"), None),
            next((p for p in parts if p.path != "softmax"), None))


def why_not(model, state, tokens) -> str | None:
    """None for the cases the C step covers; otherwise the reason (the caller falls back)."""
    if tokens.device.type != "cpu":
        return f"the native step runs on the CPU, not {tokens.device.type}"
    if state.path not in ("softmax", "linear", "window", "hybrid"):
        return f"the native step runs softmax, linear, window and hybrid states, not {state.path}"
    dtype = model.embed_tokens.weight.dtype
    if dtype not in FLOAT_TYPES:
        return f"the native step reads fp32, f16 or bf16 weights, not {str(dtype).removeprefix('torch.')}"
    kv, lin = _parts(state)
    if lin is not None:
        if lin.S.dtype != torch.float32 or lin.z.dtype != torch.float32:
            return "the native step needs an fp32 linear state"
        if lin.path == "window" and (lin.wk.dtype not in FLOAT_TYPES or lin.window < 1):
            return f"the native step reads a window of fp32, f16 or bf16 keys, not {lin.wk.dtype}"
        if lin.feature_map.name not in MODES:
            return f"the native step has no feature map {lin.feature_map.name!r}"
        if lin.feature_map.name == "hedgehog":
            maps = _learned_maps(lin.feature_map)
            if model.config.head_dim > HEDGEHOG_MAX_D:
                return f"the native step's learned maps take heads of up to {HEDGEHOG_MAX_D}, not {model.config.head_dim}"
            if any(t.dtype not in FLOAT_TYPES or t.dtype != maps[0].dtype or t.device.type != "cpu"
                   or not t.is_contiguous() for t in maps):
                return "the native step needs the learned maps as contiguous CPU tensors of one float dtype"
    if kv is not None and any(t.dtype not in FLOAT_TYPES for t in kv.tensors()):
        return f"the native step reads an fp32, f16 or bf16 KV cache, not {kv.k.dtype}"
    tensors = state.tensors()
    if not all(t.is_contiguous() for t in tensors):
        return "the native step needs a contiguous state"
    return None


class NativeStep:
    """The native form: `why_not(state, tokens)`, then `step(tokens, state)` via `__call__`.

    threads: the pool's thread count (the caller's included; RunSpec.threads); None: default_threads().
    activations: what quantized matrices (q8_0, q4_0, q4_1 blocks) multiply: "f32", the activations as
    they are against the blocks decoded in the dots (PyTorch's arithmetic), "q8", the activations
    rounded to q8 blocks and integer dots (llama.cpp's: ~3x faster here, and a greedy answer can
    flip: PITFALLS 28), or "f32-prompt": prompt blocks in f32, decode steps in q8 (the prompt read as
    PyTorch reads it, the tokens decoded at q8's speed). Float weights are the same either way."""
    name = "native"

    def __init__(self, model, threads: int | None = None, activations: str = "f32"):
        self.library = _bind(library())          # raises NativeUnavailableError without a compiler
        self.model, self.threads = model, threads
        self.q8, self.q8_prompt = {"f32": (False, False), "q8": (True, True),
                                   "f32-prompt": (True, False)}[check_activations(activations)]
        self.plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # state -> NativeDecoder

    def why_not(self, state, tokens) -> str | None:
        plan = self.plans.get(state)
        if plan is not None and plan.epoch == self.model.weights_epoch and tokens.device.type == "cpu":
            return None   # checked when the plan was made; what could change since moves the epoch
        return why_not(self.model, state, tokens)

    def _plan(self, state) -> "NativeDecoder":
        threads = self.threads or default_threads()
        plan = self.plans.get(state)
        if plan is None or not plan.still_valid(state, threads):
            plan = self.plans[state] = NativeDecoder(self.model, state, threads, q8=self.q8, q8_prompt=self.q8_prompt)
        return plan

    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor:
        return self._plan(state).step(tokens, state)

    def why_not_prefill(self, state, tokens, fastest: bool = False) -> str | None:
        """None when a prompt block (B, T) without pads can run here (as `why_not`, on a state
        that holds no pads: padded rows sit at their own rotary positions). fastest: only where it
        beats PyTorch's own GEMMs on one thread: f16 weights (measured on tiny, 512 tokens: native
        2.7-4.0k tokens/s vs 1.4k) and quantized ones (PyTorch dequantizes every matrix on every
        call: SmolLM2 Q4_1, native 562 / 731 / 608 tokens/s vs 26 / 136 / 299 for 10 / 64 / 512
        tokens); fp32 MKL and bf16 oneDNN prompt blocks are faster than this step's row dots."""
        if state.padded:
            return "a prompt block on a state with pads runs the module path"
        if getattr(_parts(state)[1], "path", None) == "window":
            return "prompt blocks of window states run the module path"
        if fastest and self.model.embed_tokens.weight.dtype != torch.float16 and not self._quantized():
            return "prompt blocks of fp32 and bf16 weights are faster on PyTorch's GEMMs"
        return self.why_not(state, tokens)

    def _quantized(self) -> bool:
        return any(isinstance(m, QuantLinear) for m in self.model.modules())

    def prefill(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (B, T) -> the last position's logits (B, 1, V), on the thread pool."""
        return self._plan(state).prefill(tokens, state)


def _learned_maps(fmap) -> list[torch.Tensor]:
    """A hedgehog map's tensors in gen.h's order: q_weight (L, H, D, D), q_bias, k_weight, k_bias."""
    return [fmap.q_weight, fmap.q_bias, fmap.k_weight, fmap.k_bias]


_DATA_PTR, _DTYPE, _VERSION = torch.Tensor.data_ptr, operator.attrgetter("dtype"), operator.attrgetter("_version")


def _ptr(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), _P)


class NativeDecoder:
    """The Plan for one (model, state) pair: weight and state pointers, scratch, made once."""

    def __init__(self, model, state, threads: int = 1, q8: bool = True, q8_prompt: bool | None = None):
        self.library = _bind(library())
        cfg = model.config
        self.model, self.epoch, self.threads = model, model.weights_epoch, threads
        layers = _layer_modules(model, model.paths_of(state))
        mats = {n: [_matrix(layer[i]) for layer in layers] for i, n in ((1, "qkv"), (2, "wo"), (4, "gu"), (5, "wd"))}
        embed, head = _matrix(model.embed_tokens), _matrix(model.lm_head)
        # fp32 weights holding only 16-bit values, q4_1 / q8_0 blocks: read from copies made once;
        # the weights behind a copy (only those) are checked for in-place edits before every step
        grouped = REGROUP and q8 and bool(self.library.gen_has_q4_1r())   # the regrouped kernels are q8 dots
        self.q8_prompt = q8 if q8_prompt is None else q8_prompt
        # prompt blocks in fp32 activations under q8 decode steps: their own tables of the blocks as stored
        plain = (None if not grouped or self.q8_prompt else
                 {n: [self._narrow(model, m, False) for m in ms] for n, ms in mats.items()},
                 self._narrow(model, embed, False), self._narrow(model, head, False))
        originals = [m for ms in mats.values() for m in ms] + [embed, head]
        mats = {n: [self._narrow(model, m, grouped) for m in ms] for n, ms in mats.items()}
        embed, head = self._narrow(model, embed, grouped), self._narrow(model, head, grouped)
        used = [m[0] for ms in mats.values() for m in ms] + [embed[0], head[0]]
        self.sources = [o[0] for o, u in zip(originals, used) if u is not o[0]]
        self.source_versions = self._versions()
        attns = [b.self_attn for b in model.layers]
        qk_norms = ([a.q_norm.weight for a in attns], [a.k_norm.weight for a in attns]) \
            if attns and attns[0].q_norm is not None else None
        norms = [layer[i] for layer in layers for i in (0, 3)] + [model.norm.weight] + \
            ([w for ws in qk_norms for w in ws] if qk_norms else [])
        # Qwen2's q/k/v biases as fp32 (copies when the model's are not: checked like every copy)
        biases = [layer[1].bias for layer in layers] if layers and layers[0][1].bias is not None else None
        self.biases = None
        if biases is not None:
            self.biases = [b.detach().float().contiguous() for b in biases]
            self.sources += [b.detach() for b, c in zip(biases, self.biases) if c.data_ptr() != b.data_ptr()]
            self.source_versions = self._versions()
        flat = [m[0] for ms in mats.values() for m in ms] + [embed[0], head[0]] + norms + (self.biases or [])
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in flat) or \
                any(m[1] < 0 for ms in mats.values() for m in ms) or embed[1] < 0 or head[1] < 0:
            raise NativeUnavailableError("the native step needs contiguous CPU weights in fp32, f16, bf16 "
                                         "or quantized blocks")
        norm_type = TYPES.get(model.norm.weight.dtype, -1)
        if norm_type < 0 or any(TYPES.get(n.dtype) != norm_type for n in norms):
            raise NativeUnavailableError("the native step needs the norm weights in one float dtype")
        kv, lin = _parts(state)
        tensors = state.tensors()   # [k, v], [S, z], or a hybrid's [k, v, S, z] (+ a window's [wk, wv])
        if lin is not None and lin.path == "window":
            tensors = tensors + [lin.wreal]   # (B, W) bool, shifted in place by commit: checked too
        learned = lin is not None and lin.feature_map.name == "hedgehog"
        maps = [t.detach() for t in _learned_maps(lin.feature_map)] if learned else []
        flat += maps                # checked before every step as the weights are
        # a learned decay's factors exp(FeatureMap.decay), every layer's, computed once per plan: a copy,
        # so the logits behind it are checked for in-place edits as the other copied weights are
        # (gated: fp32 copies of the logits and the gate, the factors computed per token in C)
        self.decay = self.gate = None
        if learned and lin.feature_map.has_gate:
            fm = lin.feature_map
            self.gate = [fm.decay_logit.detach().float().contiguous(), fm.gate_weight.detach().float().contiguous()]
            self.sources += [fm.decay_logit.detach(), fm.gate_weight.detach()]
            self.source_versions = self._versions()
        elif learned and lin.feature_map.has_decay:
            self.decay = lin.feature_map.decay(slice(None)).detach().float().exp().contiguous()
            self.sources.append(lin.feature_map.decay_logit.detach())
            self.source_versions = self._versions()
        H, Hkv, D, I, C, B = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              cfg.intermediate_size, cfg.hidden_size, state.batch_size)
        F_ = lin.feature_map.out_dim(D) if lin is not None else 0
        self.widths = (("x", C), ("xb", C), ("qkv_out", (H + 2 * Hkv) * D), ("att", H * D), ("gu_out", 2 * I), ("hb", I))
        self.scratch = {n: torch.zeros(B, size) for n, size in self.widths}
        self.chains = []   # the segments of stacked matrices (Mat.rest): alive as long as the plan
        self.tables = {n: (Mat * cfg.num_hidden_layers)(*[_mat(m, self.chains) for m in ms])
                       for n, ms in mats.items()}
        self.plain_tables = None if plain[0] is None else (
            {n: (Mat * cfg.num_hidden_layers)(*[_mat(m, self.chains) for m in ms]) for n, ms in plain[0].items()},
            _mat(plain[1], self.chains), _mat(plain[2], self.chains))
        self.norm_tables = {n: (_V * cfg.num_hidden_layers)(*[layer[i].data_ptr() for layer in layers])
                            for i, n in ((0, "ln1"), (3, "ln2"))}
        if qk_norms is not None:
            self.norm_tables.update({n: (_V * cfg.num_hidden_layers)(*[w.data_ptr() for w in ws])
                                     for n, ws in zip(("q_norm", "k_norm"), qk_norms)})
        if self.biases is not None:
            self.bias_table = (_P * cfg.num_hidden_layers)(*[_ptr(b) for b in self.biases])
        self.flat, self.tensors = flat, tensors
        self.checked = flat + tensors
        # The storages themselves: memory the plan points into is never freed while it lives, even
        # if a Parameter's storage is swapped in a way nothing reports (then the checks rebuild it).
        self.storages = [t.untyped_storage() for t in flat + tensors]
        self.pointers = self._pointers()
        mode = MODES[lin.feature_map.name] if lin is not None else 0
        fields = dict(mode=mode, F=F_, S_max=kv.max_len if kv is not None else 0, linear_rope=int(cfg.linear_rope),
                      q8_acts=int(q8))
        if lin is not None:
            fields.update(S=_ptr(lin.S), z=_ptr(lin.z))
        if lin is not None and lin.path == "window":
            fields.update(wk=lin.wk.data_ptr(), wv=lin.wv.data_ptr(), w_type=TYPES[lin.wk.dtype], W=lin.window,
                          wreal=lin.wreal.data_ptr())
        if kv is not None:
            fields.update(k=kv.k.data_ptr(), v=kv.v.data_ptr(), kv_type=TYPES[kv.k.dtype])
        if maps:
            fields.update({n: t.data_ptr() for n, t in zip(("hq_w", "hq_b", "hk_w", "hk_b"), maps)},
                          hh_type=TYPES[maps[0].dtype])
        if self.gate is not None:
            fields.update(hh_logit=_ptr(self.gate[0]), hh_gate=_ptr(self.gate[1]))
        elif self.decay is not None:
            fields.update(hh_decay=_ptr(self.decay))
        if self.biases is not None:
            fields.update(qkv_bias=self.bias_table)
        if state.path == "hybrid":   # per model layer: its mode, and its layer inside its part
            self.layer_mode = (ctypes.c_int * len(state.where))(
                *[0 if p == "softmax" else mode for p in state.layer_paths])
            self.layer_index = (ctypes.c_int * len(state.where))(*[j for _, j in state.where])
            fields.update(layer_mode=self.layer_mode, layer_index=self.layer_index)
        self.plan = Plan(L=cfg.num_hidden_layers, C=C, H=H, Hkv=Hkv, D=D, I=I, V=cfg.vocab_size, B=B,
                         eps=cfg.rms_norm_eps, scale=D ** -0.5,
                         embed=_mat(embed, self.chains), head=_mat(head, self.chains),
                         norm=model.norm.weight.data_ptr(), norm_type=norm_type, lin_eps=EPS,
                         nthreads=max(1, threads), **fields, **self.tables, **self.norm_tables,
                         **{n: _ptr(t) for n, t in self.scratch.items()})
        self.plan_ref = ctypes.byref(self.plan)
        if self.library.gen_plan_init(self.plan_ref) != 0:
            raise NativeUnavailableError("the native step could not allocate its thread scratch")
        self.rope = model.uses_rope(state.path)
        self._rope_tables = None   # fp32 (cos, sin), kept here: fetched again only to grow
        self.V, self.D, self.B = cfg.vocab_size, D, B
        self.prefill_plan = self.prefill_ref = None   # made on the first prompt block

    def __del__(self):
        for plan, ref in ((getattr(self, "plan", None), getattr(self, "plan_ref", None)),
                          (getattr(self, "prefill_plan", None), getattr(self, "prefill_ref", None))):
            if ref is not None and plan.tscratch:
                self.library.gen_plan_free(ref)   # waits until no pool worker is inside this plan's chunks

    def _prefill_plan(self):
        """The decode plan's twin for prompt blocks: PREFILL_ROWS rows of scratch, the same weights
        and state; row r is token r of one sequence's block (gen_prefill_block)."""
        if self.prefill_plan is None:
            self.prefill_scratch = {n: torch.zeros(PREFILL_ROWS, size) for n, size in self.widths}
            plan = Plan()
            ctypes.memmove(ctypes.byref(plan), self.plan_ref, ctypes.sizeof(Plan))   # every field, then rows and scratch
            plan.tscratch, plan.tscratch_floats = None, 0
            plan.B, plan.Bc = PREFILL_ROWS, self.B
            plan.q8_acts = int(self.q8_prompt)
            if self.plain_tables is not None:   # fp32 activations read the blocks as stored, not regrouped
                tables, plan.embed, plan.head = self.plain_tables
                for n, t in tables.items():
                    setattr(plan, n, t)
            for n, t in self.prefill_scratch.items():
                setattr(plan, n, _ptr(t))
            ref = ctypes.byref(plan)
            if self.library.gen_plan_init(ref) != 0:
                raise NativeUnavailableError("the native step could not allocate its thread scratch")
            self.prefill_plan, self.prefill_ref = plan, ref
        return self.prefill_ref

    def prefill(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (B, T), no pads, on a state without pads -> the last position's logits (B, 1, V);
        writes T cache slots per row (or T linear updates) and advances the state."""
        span = state.open(tokens)            # shape and capacity checks, as PyTorch
        B, T = tokens.shape
        ids = tokens.to(torch.int64).contiguous()
        lo, hi = ids.aminmax()
        if int(lo) < 0 or int(hi) >= self.V:
            raise IndexError(f"token id {int(lo) if int(lo) < 0 else int(hi)} outside the vocabulary "
                             f"(0..{self.V - 1})")
        ref = self._prefill_plan()
        cos = sin = None
        if self.rope:
            cos, sin = self.model.rotary.table(span.start + T, tokens.device, torch.float32)   # (S, D)
        logits = torch.empty(B, 1, self.V)
        row_bytes = 8 * T
        for b in range(B):
            self.prefill_plan.seq = b
            for t0 in range(0, T, PREFILL_ROWS):
                n = min(PREFILL_ROWS, T - t0)
                slot = span.start + t0
                rope = (None, None) if cos is None else (cos[slot].data_ptr(), sin[slot].data_ptr())
                out = logits[b].data_ptr() if t0 + n == T else None     # the head for the last block only
                self.library.gen_prefill_block(ref, PREFILL_ROWS, n, ids.data_ptr() + b * row_bytes + 8 * t0, slot,
                                               *rope, None, out)
        state.commit(span)
        return logits

    @staticmethod
    def _narrow(model, m: tuple, grouped: bool) -> tuple:
        """The tensor the C step reads for matrix m: a 16-bit copy of exactly-16-bit fp32 weights,
        q4_1 / q8_0 blocks regrouped where `grouped` (this build has those kernels), else m's own
        (a QuantStack's segments: as stored)."""
        if len(m) > 4:
            return m
        if m[1] in (TYPES["q4_1"], TYPES["q8_0"]) and grouped:
            q41 = m[1] == TYPES["q4_1"]
            return _regrouped(model, m[0], m[2], q41), T_Q4_1R if q41 else T_Q8_0R, m[2], m[3]
        w = _exact16(model, m[0])
        return m if w is m[0] else (w, TYPES[w.dtype], m[2], m[3])

    def _versions(self) -> tuple:
        return list(map(_DATA_PTR, self.sources)), list(map(_VERSION, self.sources))

    def _pointers(self) -> tuple:
        """(data pointers, dtypes) of every weight and state tensor the plan points into. (A device
        change always comes with new storage, so a new pointer, and moves the model's epoch.)"""
        return list(map(_DATA_PTR, self.checked)), list(map(_DTYPE, self.checked))

    def still_valid(self, state, threads: int) -> bool:
        """The plan's pointers are still the tensors' own (checked before every step)."""
        if self.epoch != self.model.weights_epoch or threads != self.threads:
            return False   # .to()/load_state_dict/quantize: Parameter objects or their storage were replaced
        return (self._pointers() == self.pointers and state.tensors()[0] is self.tensors[0]
                and self._versions() == self.source_versions)

    def _rope_rows(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 rotary tables with at least n rows: the model's, asked for again only when they
        must grow (holding them keeps the rows read alive whatever the model's table does next)."""
        t = self._rope_tables
        if t is None or t[0].shape[0] < n:
            t = self._rope_tables = self.model.rotary.table(n, device, torch.float32)
        return t

    def step(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (B, 1) -> logits (B, 1, V); writes one cache slot per row and advances the state."""
        span = state.open(tokens)            # shape and capacity checks (ContextFullError), as PyTorch
        ids = tokens.reshape(self.B)
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = ids.to(torch.int64).contiguous()
        vals = ids.tolist()   # one call (indexing and int() of a tensor cost ~7 us a step on small models)
        lo, hi = min(vals), max(vals)
        if lo < 0 or hi >= self.V:
            raise IndexError(f"token id {lo if lo < 0 else hi} outside the vocabulary (0..{self.V - 1})")
        cos = sin = None
        stride = 0
        padded = state.padded
        if self.rope:
            if padded:   # row b sits at rotary position lengths[b]
                n = int(state.lengths.max()) + 1
                c, s = self.model.rotary.table(n, tokens.device, torch.float32)
                rows_c, rows_s = c[state.lengths].contiguous(), s[state.lengths].contiguous()   # (B, D)
                cos, sin, stride = rows_c.data_ptr(), rows_s.data_ptr(), self.D
            else:
                pos = span.start
                c, s = self._rope_rows(pos + 1, tokens.device)
                cos, sin = c.data_ptr() + pos * self.D * 4, s.data_ptr() + pos * self.D * 4
        real = None
        kv = _parts(state)[0] if padded else None
        if kv is not None:
            real = kv.slot_real.data_ptr()   # (B, S_max) bool, one byte each
        logits = torch.empty(self.B, 1, self.V)
        self.library.gen_decode_step(self.plan_ref, ids.data_ptr(), span.start, cos, sin, stride, real,
                                     logits.data_ptr())
        state.commit(span)
        return logits
