"""The binding of the compiled step: gen.h's structs and codes mirrored in ctypes, checked against C.

    lib = bind()          # library() with every function's signature set, its layout checked first

`Mat` and `Plan` copy gen.h's declarations field for field. gen.h cannot be read by ctypes, so the
C side exports its own table of every field's name, byte offset and size (decode.c `gen_abi`) and
`bind` compares this mirror with it before any function is called: a field added, moved or retyped
on one side only raises `NativeABIError` (a `NativeUnavailableError`: the auto backend falls back to
torch with the reason) instead of letting the step read a plan at the wrong bytes. The type codes of
the block kinds (`TYPES`) are checked the same way against the C side's table of kinds (code and
block bytes, which must also be engine.quant's).
"""
from __future__ import annotations

import ctypes

import torch

from engine.quant import K_BLOCK_BYTES, WIDE_BLOCK_BYTES
from engine.steps.native.build import NativeUnavailableError, library

ABI_VERSION = 1   # decode.c's GEN_ABI_VERSION: a field's meaning changed without its layout

_P = ctypes.POINTER(ctypes.c_float)
_V = ctypes.c_void_p
# gen.h's element types (T_*) of weights, caches and maps; the quantized kinds as engine.quant names them
TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, "q8_0": 3, "q4_0": 4, "q4_1": 5,
         "q4_k": 8, "q5_k": 9, "q6_k": 10, "q5_0": 11, "q5_1": 12}
T_Q4_1R, T_Q8_0R = 6, 7   # gen.h: q4_1 / q8_0 blocks regrouped per row (engine.steps.native.weights.regroup)
T_Q5R = 13                # gen.h: q5_0 / q5_1 blocks regrouped per row (engine.steps.native.weights.regroup_q5)
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
MODES = {"elu1": 1, "relu": 2, "softmax": 3, "cos1": 4, "hedgehog": 5}   # linear feature maps; 0 is softmax attention
HEDGEHOG_MAX_D = 256   # gen.h


class NativeABIError(NativeUnavailableError):
    """This ctypes mirror of gen.h's structs does not match the compiled library's layout."""


class Mat(ctypes.Structure):   # gen.h Mat
    pass


Mat._fields_ = [("data", _V), ("type", ctypes.c_int), ("rows", ctypes.c_int), ("cols", ctypes.c_int),
                ("split", ctypes.c_int), ("rest", ctypes.POINTER(Mat))]


class Plan(ctypes.Structure):   # gen.h Plan, field for field (checked by `bind`)
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
                + [("qkv_bias", ctypes.POINTER(_P)), ("q_norm", ctypes.POINTER(_V)), ("k_norm", ctypes.POINTER(_V))]
                + [(n, _V) for n in ("rk", "rv", "ck", "cv", "cuse", "sp_held")] + [("R", ctypes.c_int), ("M", ctypes.c_int)])


def _c_layout(lib, s: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """(sizeof, {field: (offset, size)}) of gen.h struct s (0 Mat, 1 Plan), as the library was compiled."""
    name, offset, size = ctypes.c_char_p(), ctypes.c_size_t(), ctypes.c_size_t()
    args = (ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size))
    lib.gen_abi(s, -1, *args)
    total, fields, i = size.value, {}, 0
    while lib.gen_abi(s, i, *args) == 0:
        fields[name.value.decode()] = (offset.value, size.value)
        i += 1
    return total, fields


def _c_kinds(lib) -> dict[str, tuple[int, int]]:
    """{block kind: (type code, block bytes)} as the library was compiled (gen_abi's table 2)."""
    name, code, size = ctypes.c_char_p(), ctypes.c_size_t(), ctypes.c_size_t()
    out, i = {}, 0
    while lib.gen_abi(2, i, ctypes.byref(name), ctypes.byref(code), ctypes.byref(size)) == 0:
        out[name.value.decode()] = (code.value, size.value)
        i += 1
    return out


def kind_problems(lib, types=None) -> list[str]:
    """What differs between `types` (this module's TYPES unless given) with engine.quant's block bytes
    and the library's table of block kinds; [] when they agree."""
    types = TYPES if types is None else types
    ours = {k: (code, {**WIDE_BLOCK_BYTES, **K_BLOCK_BYTES}.get(k)) for k, code in types.items() if isinstance(k, str)}
    theirs = _c_kinds(lib)
    problems = [f"block kind {k} is missing here (gen.h: type {theirs[k][0]})" for k in theirs if k not in ours]
    problems += [f"block kind {k} is not in gen.h" for k in ours if k not in theirs]
    problems += [f"block kind {k} is type {c[0]} of {c[1]}-byte blocks in gen.h, type {o[0]} of {o[1]} here"
                 for k, c in theirs.items() if (o := ours.get(k)) is not None and o != c]
    return problems


def layout_problems(lib, mat=None, plan=None, types=None) -> list[str]:
    """What differs between the ctypes mirror (`mat`, `plan`: this module's Mat and Plan unless
    given; `types`: its TYPES) and the library's own layout; [] when they agree."""
    if not hasattr(lib, "gen_abi"):
        return ["the library exports no layout (gen_abi)"]
    lib.gen_abi.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                            ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    lib.gen_abi.restype = ctypes.c_int
    lib.gen_abi_version.argtypes, lib.gen_abi_version.restype = [], ctypes.c_int
    problems = []
    if lib.gen_abi_version() != ABI_VERSION:
        problems.append(f"ABI version {lib.gen_abi_version()} in C, {ABI_VERSION} here")
    for s, cls in enumerate((mat or Mat, plan or Plan)):
        struct = ("Mat", "Plan")[s]
        size, c_fields = _c_layout(lib, s)
        py_fields = {n: (getattr(cls, n).offset, getattr(cls, n).size) for n, *_ in cls._fields_}
        problems += [f"{struct}.{n} is missing here (gen.h: byte {c_fields[n][0]})" for n in c_fields if n not in py_fields]
        problems += [f"{struct}.{n} is not in gen.h" for n in py_fields if n not in c_fields]
        problems += [f"{struct}.{n} at byte {c[0]} ({c[1]} bytes) in gen.h, {p[0]} ({p[1]} bytes) here"
                     for n, c in c_fields.items() if (p := py_fields.get(n)) is not None and p != c]
        if ctypes.sizeof(cls) != size:
            problems.append(f"sizeof({struct}) {size} in gen.h, {ctypes.sizeof(cls)} here")
    return problems + kind_problems(lib, types)


def check_layout(lib, mat=None, plan=None, types=None) -> None:
    """Raise NativeABIError (one line: the first differences) unless the mirror matches the library."""
    problems = layout_problems(lib, mat, plan, types)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise NativeABIError("the native step's ctypes mirror of gen.h (engine/steps/native/abi.py) does not match "
                             f"the compiled library: {'; '.join(problems[:3])}{more}; make abi.py's Mat, Plan "
                             "and TYPES copy gen.h field for field")


def bind(lib=None) -> ctypes.CDLL:
    """The compiled step (library() unless given) with every entry point's signature set, once its
    layout matches this module's Mat, Plan and TYPES (checked again whenever they change)."""
    lib = library() if lib is None else lib
    if getattr(lib, "_gen_bound", None) == (Mat, Plan, TYPES):
        return lib
    check_layout(lib)
    plan = ctypes.POINTER(Plan)
    signatures = {
        "gen_plan_init": ([plan], ctypes.c_int),
        "gen_plan_free": ([plan], None),
        "gen_decode_step": ([plan, _V, ctypes.c_int, _V, _V, ctypes.c_int, _V, _V], None),
        "gen_prefill_block": ([plan, ctypes.c_int, ctypes.c_int, _V, ctypes.c_int, _V, _V, _V, _V], None),
        "gen_prefill_layers": ([plan, ctypes.c_int, ctypes.c_int, _V, ctypes.c_int, _V, _V, _V, _V, ctypes.c_int,
                                ctypes.c_int], None),
        "gen_set_parallel_min": ([ctypes.c_longlong], None),
        "gen_pool_adapt": ([ctypes.c_int, ctypes.c_int, ctypes.c_longlong], None),
        "gen_pool_rest": ([], None),
        "gen_pool_spin": ([ctypes.c_longlong], None),
        "gen_pool_workers": ([ctypes.POINTER(ctypes.c_int)], None),
        "gen_pool_stats": ([ctypes.POINTER(ctypes.c_longlong), ctypes.c_int], None),
        "gen_has_q4_1r": ([], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    lib._gen_bound = (Mat, Plan, dict(TYPES))
    return lib


def mat(m: tuple, keep: list) -> Mat:
    """The gen.h Mat of a matrix tuple (engine.steps.native.weights.matrix); a QuantStack's (5 items)
    chains its segments through Mat.rest (the chained Mats go to `keep`, which must live as long as
    the Mat is used)."""
    base = m[0].data_ptr()
    if len(m) == 4:
        return Mat(base, m[1], m[2], m[3])
    mats = [Mat(base + off, t, rows, m[3]) for off, t, rows in m[4]]
    for i in range(len(mats) - 2, -1, -1):   # each segment's rows = its own and those after it
        mats[i].split, mats[i].rows = mats[i].rows, mats[i].rows + mats[i + 1].rows
        mats[i].rest = ctypes.pointer(mats[i + 1])
    keep.append(mats)
    return mats[0]


def ptr(t: torch.Tensor):
    """A float tensor's data as a gen.h float pointer."""
    return ctypes.cast(t.data_ptr(), _P)
