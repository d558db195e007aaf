"""What the C step reads for each weight: the model's own tensors, or copies derived from them once.

    copies = DerivedWeights(exact16=True, regroup=True)   # owned by one NativeStep, never by the model
    copies.narrow(matrix(module), grouped)                # the (tensor, type, rows, cols) the plan points at

Two kinds of copies, each made once per (tensor, storage, version) and kept by the step that made
them (a weak key: the cache never keeps a weight alive, and forgets a copy when its weight dies):
  exact16    fp32 weights holding only 16-bit values (a checkpoint stored in f16 or bf16, loaded in
             fp32) as f16 / bf16 copies: the same fp32 products from half the bytes
  regrouped  q4_1 / q8_0 / q5_0 / q5_1 blocks regrouped per row for the grouped q8 kernels (gen.h
             T_Q4_1R / T_Q8_0R / T_Q5R);
             the step reads only these afterwards (fp32 prompt blocks too), so the originals' pages are
             handed back to the kernel (`page_out`: a GGUF's memory-mapped blocks leave the resident
             set and fault back in from the file if PyTorch code reads them again)
A model's own q4_1 / q8_0 blocks (a copy the loader fused, `--quantize`'s, merged adapters': not a
view of a file) need no copy: the plan holds them grouped in place (engine.quant.QuantLinear.group,
the same values; PyTorch forms ungroup them per call), so they are resident once, not twice.
A plan checks the weights behind its copies for in-place edits before every step (their version).
"""
from __future__ import annotations

import weakref

import torch

from engine.quant import QuantLinear, QuantStack, group_rows, ungroup_rows, weights_label
from engine.steps.native.abi import T_Q4_1R, T_Q5R, T_Q8_0R, TYPES
from models.pages import FAULT_AROUND, hand_back

GROUPED = {"q4_1": T_Q4_1R, "q8_0": T_Q8_0R}   # a grouped QuantLinear's kind -> the type code of its blocks


def layer_modules(model, paths) -> list[tuple]:
    """Per layer: (ln1 weight, qkv, o_proj, ln2 weight, gate_up, down_proj) -- Linear or QuantLinear;
    a linear layer's adapted projections where the model carries them."""
    return [(b.input_layernorm.weight, *b.self_attn.projections(p != "softmax"), b.post_attention_layernorm.weight,
             b.mlp.gate_up, b.mlp.down_proj) for b, p in zip(model.layers, paths)]


def matrix(module) -> tuple:
    """(tensor the C code reads, type code, rows, cols) of a Linear, QuantLinear or Embedding; a
    QuantStack's adds its segments, (byte offset in its blocks, type code, rows) each."""
    if isinstance(module, QuantStack):
        segs, at = [], 0
        for kind, rows, b in module.segments():
            segs.append((at, TYPES[kind], rows))
            at += b.numel()
        return module.blocks, segs[0][1], module.out_features, module.in_features, segs
    if isinstance(module, QuantLinear):
        kind = GROUPED[module.kind] if module.grouped else TYPES[module.kind]
        return module.blocks, kind, module.out_features, module.in_features
    w = module.weight
    return w, TYPES.get(w.dtype, -1), w.shape[0], w.shape[1]


def narrow16(w: torch.Tensor) -> torch.Tensor | None:
    """An f16 (else bf16) copy of fp32 `w` that holds its every value exactly, else None.

    Widening f16 or bf16 to fp32 is exact, so the C step computes the same fp32 products from half
    the bytes: a checkpoint stored in 16 bits and loaded in fp32 (tiny: f16; most Hugging Face
    checkpoints: bf16) decodes bit-identically, reading half the memory per token."""
    for dtype in (torch.float16, torch.bfloat16):
        c = w.to(dtype)
        if torch.equal(c.float(), w):
            return c
    return None


def regroup(blocks: torch.Tensor, rows: int, q4_1: bool) -> torch.Tensor:
    """q4_1 (else q8_0) blocks regrouped per row for the grouped kernels (engine.quant.group_rows)."""
    return group_rows(blocks, rows, "q4_1" if q4_1 else "q8_0")


def regroup_q5(blocks: torch.Tensor, rows: int, kind: str) -> torch.Tensor | None:
    """q5_0 / q5_1 blocks regrouped per row for the C step's grouped kernel (gen.h T_Q5R), 24 bytes a
    block: every block's f16 (d, m) pair (q5_0's w = d (q - 16) as d q + m with m = -16 d, exact in
    f16 but where d is beyond 4094 or not finite: then None, the blocks run as stored), then every
    block's qh (within each full group of 4 blocks their low 16 bits, then their high 16 bits: the
    5th bits of the group load's low and high nibbles, one mask each), then every 16-byte nibble
    block. Written into the one new tensor. (q5_0's d q + m is d (q - 16) exactly, but +0 where
    that is -0: the same value, a zero's sign aside.)"""
    one = kind == "q5_1"
    size, head = (24, 4) if one else (22, 2)
    per_row = blocks.reshape(rows, -1, size)
    n = per_row.shape[1]
    full = n // 4 * 4
    out = torch.empty(rows, n * 24, dtype=torch.uint8, device=blocks.device)
    dm = out[:, :4 * n].view(rows, n, 4)
    dm[:, :, :head].copy_(per_row[:, :, :head])
    if not one:   # m = -16 d, when every one is an exact f16
        d = per_row[:, :, :2].contiguous().view(torch.float16).float()
        m = (-16 * d).to(torch.float16)
        if not torch.equal(m.float(), -16 * d):
            return None
        dm[:, :, 2:].copy_(m.view(torch.uint8))
    qh, src = out[:, 4 * n:8 * n].view(rows, n, 4), per_row[:, :, head:head + 4]
    qh[:, :full].view(rows, full // 4, 2, 4, 2).copy_(src[:, :full].reshape(rows, full // 4, 4, 2, 2).transpose(2, 3))
    qh[:, full:].copy_(src[:, full:])
    out[:, 8 * n:].view(rows, n, 16).copy_(per_row[:, :, head + 4:])
    return out


def page_out(t: torch.Tensor) -> bool:
    """Hand the whole pages inside a CPU tensor's bytes back to the kernel without changing a value
    (models.pages.hand_back): a memory map's pages of a file are dropped and read again from the file
    on the next touch (even where another process maps the same file), anonymous ones go to swap if
    there is any. False where the platform cannot."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    return hand_back(t.data_ptr(), t.numel() * t.element_size(), around=FAULT_AROUND)


class DerivedWeights:
    """The copies one step reads instead of the model's weights (see the module docstring).

    exact16: fp32 weights of 16-bit values run from 16-bit copies (False: from the fp32 tensors);
    regroup: q4_1 / q8_0 / q5 blocks run regrouped where the build has those kernels (False: as stored)."""

    def __init__(self, exact16: bool = True, regroup: bool = True):
        self.exact16_on, self.regroup_on = bool(exact16), bool(regroup)
        self._cache: dict = {}   # (tag, id(w)) -> (weakref to w, (data_ptr, version), copy or None)
        self.made = 0            # copies made so far (a step trims the heap after a plan made some)

    def _derived(self, w: torch.Tensor, tag: str, make) -> torch.Tensor | None:
        """make(w) (a tensor, or None: nothing to derive), made once per (tensor, storage, version);
        the cache holds no strong reference to `w` and drops the entry when `w` dies. A tensor
        changed in place moves its version, which the plan checks before every step."""
        key = (tag, id(w))
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is w and hit[1] == (w.data_ptr(), w._version):
            return hit[2]
        with torch.no_grad():
            out = make(w)
        self.made += 1
        owner = weakref.ref(self)   # not self: the callback must not keep the copies alive

        def forget(ref, key=key):
            cache = getattr(owner(), "_cache", {})
            if cache.get(key, (None,))[0] is ref:
                del cache[key]
        self._cache[key] = (weakref.ref(w, forget), (w.data_ptr(), w._version), out)
        return out

    def exact16(self, w: torch.Tensor) -> torch.Tensor:
        """The 16-bit copy of an fp32 CPU weight that holds its values exactly (narrow16), else `w`."""
        if not self.exact16_on or w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
            return w
        copy = self._derived(w, "exact16", narrow16)
        return w if copy is None else copy

    def regrouped(self, blocks: torch.Tensor, rows: int, q4_1: bool) -> torch.Tensor:
        """`regroup(blocks, rows, q4_1)`, made once; the original's pages handed back (`page_out`)."""
        def make(b):
            out = regroup(b, rows, q4_1)
            page_out(b)
            return out
        return self._derived(blocks, "regrouped", make)

    def regrouped_q5(self, blocks: torch.Tensor, rows: int, kind: str) -> torch.Tensor | None:
        """`regroup_q5(blocks, rows, kind)`, made once (None: it does not apply); the original's pages
        handed back when it does (`page_out`)."""
        def make(b):
            out = regroup_q5(b, rows, kind)
            if out is not None:
                page_out(b)
            return out
        return self._derived(blocks, "regrouped-q5", make)

    def ungrouped(self, blocks: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
        """A grouped module's blocks as stored (engine.quant.ungroup_rows), made once: for a q8 step that
        does not read the grouped layout (a build without those kernels, or regroup off)."""
        return self._derived(blocks, "ungrouped", lambda b: ungroup_rows(b, rows, kind))

    def narrow(self, m: tuple, grouped: bool, q8: bool = True) -> tuple:
        """The matrix tuple the C step reads for `m` (a `matrix` tuple): a 16-bit copy of exactly-16-bit
        fp32 weights, q4_1 / q8_0 / q5 blocks regrouped where `grouped` (this build has those kernels and
        the step rounds activations to q8), else m's own (a QuantStack's segments: as stored). A model's
        own blocks already held grouped are read as they are, except by a q8 step that is not `grouped`
        (a copy as stored)."""
        if len(m) > 4:
            return m
        if m[1] in (T_Q4_1R, T_Q8_0R):   # a module's own blocks held grouped (QuantLinear.group)
            if grouped or not q8:         # (the fp32 kernels read that layout in every build)
                return m
            kind = "q4_1" if m[1] == T_Q4_1R else "q8_0"
            return self.ungrouped(m[0], m[2], kind), TYPES[kind], m[2], m[3]
        if m[1] in (TYPES["q4_1"], TYPES["q8_0"]) and grouped:
            q41 = m[1] == TYPES["q4_1"]
            return self.regrouped(m[0], m[2], q41), T_Q4_1R if q41 else T_Q8_0R, m[2], m[3]
        if m[1] in (TYPES["q5_0"], TYPES["q5_1"]) and grouped:
            q5 = self.regrouped_q5(m[0], m[2], "q5_1" if m[1] == TYPES["q5_1"] else "q5_0")
            return m if q5 is None else (q5, T_Q5R, m[2], m[3])
        w = self.exact16(m[0])
        return m if w is m[0] else (w, TYPES[w.dtype], m[2], m[3])

    def weights_read(self, model) -> str:
        """What the step reads for the model's matrices, as engine.quant.weights_label names them."""
        return weights_label(model, view=self.exact16)


def weights_read(model, exact16: bool = True) -> str:
    """What the native step reads for the model's matrices (projections and lm_head), most bytes
    first, as engine.quant.weights_label names them: "float16" for tiny loaded in fp32 (its
    f16 checkpoint's values, read from the exact 16-bit copies), "q4_1+q8_0" for a GGUF's blocks.
    (Computed here, keeping no copy; a NativeStep's `weights_read()` reuses the copies it holds.)"""
    return DerivedWeights(exact16=exact16).weights_read(model)
