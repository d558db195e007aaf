"""The Plan of one (model, state) pair: the pointers, scratch and shapes the C step runs on.

A `NativeDecoder` fills gen.h's Plan once: the weights the step reads (the model's own tensors, or
the copies its NativeStep's DerivedWeights made), the state's tensors, per-row scratch, and the
thread count. Before every step its NativeStep asks `still_valid`: each pointer, dtype and the
version of every weight behind a copy must be the plan's (`model.half().float()` swaps the storage
under the same Parameter objects: stepping on with old pointers would read freed memory). The plan
holds the storages it points into, so that memory outlives it whatever happens to the Parameters;
it is freed only after the thread pool has no worker left inside one of its chunks.
"""
from __future__ import annotations

import ctypes
import operator

import torch

from engine.attention.linear import EPS
from engine.attention.sparse import BLOCK as SPARSE_BLOCK, SparseWindowState, held
from engine.quant import QuantLinear
from engine.steps.native.abi import MODES, TYPES, Mat, NativeUnavailableError, Plan, bind, mat, ptr
from engine.steps.native.cases import kv_rows, learned_maps, state_parts
from engine.steps.native.weights import DerivedWeights, layer_modules, matrix
from models.pages import trim_heap

PREFILL_ROWS = 64   # a prompt block runs this many tokens at a time (the rows of one batched step)
_V = ctypes.c_void_p
_P = ctypes.POINTER(ctypes.c_float)
_DATA_PTR, _DTYPE, _VERSION = torch.Tensor.data_ptr, operator.attrgetter("dtype"), operator.attrgetter("_version")


def cache_rows(kv) -> int:
    """kv_rows, a layout it refuses raised."""
    rows = kv_rows(kv)
    if rows is None:
        raise NativeUnavailableError("the native step needs a KV cache laid out (L, B, Hkv, S, D), rows contiguous")
    return rows


class NativeDecoder:
    """The Plan for one (model, state) pair: weight and state pointers, scratch, made once.

    weights: the copies the plan may read instead of the model's tensors (its NativeStep's; None: a
    DerivedWeights of its own). q8: quantized matrices round decode activations to q8 blocks;
    q8_prompt: prompt blocks too (None: as q8)."""

    def __init__(self, model, state, threads: int = 1, q8: bool = True, q8_prompt: bool | None = None,
                 weights: DerivedWeights | None = None):
        self.library = bind()
        cfg = model.config
        self.model, self.epoch, self.threads = model, model.weights_epoch, threads
        self.q8_prompt = q8 if q8_prompt is None else q8_prompt
        layers = layer_modules(model, model.paths_of(state))
        self.sources: list[torch.Tensor] = []   # the weights behind copies: checked for in-place edits
        mats, embed, head = self._matrices(model, layers, weights or DerivedWeights(), q8)
        norms, qk_norms, norm_type = self._norms(model, layers)
        flat = [m[0] for ms in mats.values() for m in ms] + [embed[0], head[0]] + norms + (self.biases or [])
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in flat) or \
                any(m[1] < 0 for ms in mats.values() for m in ms) or embed[1] < 0 or head[1] < 0:
            raise NativeUnavailableError("the native step needs contiguous CPU weights in fp32, f16, bf16 "
                                         "or quantized blocks")
        if norm_type < 0 or any(TYPES.get(n.dtype) != norm_type for n in norms):
            raise NativeUnavailableError("the native step needs the norm weights in one float dtype")
        kv, lin = state_parts(state)
        self.cache_rows = state.batch_size if kv is None else cache_rows(kv)
        tensors = state.tensors()   # [k, v], [S, z], or a hybrid's [k, v, S, z] (+ a window's [wk, wv])
        if lin is not None and lin.path == "window":
            # a window's (B, W) bool, shifted in place by commit; a sparse cache's slots in use: checked too
            tensors = tensors + [lin.cuse if isinstance(lin, SparseWindowState) else lin.wreal]
        learned = lin is not None and lin.feature_map.name == "hedgehog"
        maps = [t.detach() for t in learned_maps(lin.feature_map)] if learned else []
        flat += maps                # checked before every step as the weights are
        self._decay_copies(lin if learned else None)
        self.source_versions = self._versions()
        H, Hkv, D, I, C, B = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              cfg.intermediate_size, cfg.hidden_size, state.batch_size)
        self.widths = (("x", C), ("xb", C), ("qkv_out", (H + 2 * Hkv) * D), ("att", H * D), ("gu_out", 2 * I), ("hb", I))
        self.scratch = {n: torch.zeros(B, size) for n, size in self.widths}
        self._tables(cfg.num_hidden_layers, mats, layers, qk_norms)
        self.flat, self.tensors = flat, tensors
        self.checked = flat + tensors
        # The storages themselves: memory the plan points into is never freed while it lives, even
        # if a Parameter's storage is swapped in a way nothing reports (then the checks rebuild it).
        self.storages = [t.untyped_storage() for t in flat + tensors]
        self.pointers = self._pointers()
        fields = self._state_fields(state, kv, lin, maps, q8)
        self.plan = Plan(L=cfg.num_hidden_layers, C=C, H=H, Hkv=Hkv, D=D, I=I, V=cfg.vocab_size, B=B,
                         eps=cfg.rms_norm_eps, scale=D ** -0.5,
                         embed=mat(embed, self.chains), head=mat(head, self.chains),
                         norm=model.norm.weight.data_ptr(), norm_type=norm_type, lin_eps=EPS,
                         nthreads=max(1, threads), **fields, **self.tables, **self.norm_tables,
                         **{n: ptr(t) for n, t in self.scratch.items()})
        self.plan_ref = ctypes.byref(self.plan)
        if self.library.gen_plan_init(self.plan_ref) != 0:
            raise NativeUnavailableError("the native step could not allocate its thread scratch")
        self.rope = model.uses_rope(state.path)
        self._rope_tables = None   # fp32 (cos, sin), kept here: fetched again only to grow
        self.V, self.D, self.B, self.L = cfg.vocab_size, D, B, cfg.num_hidden_layers
        self.prefill_plan = self.prefill_ref = None   # made on the first prompt block

    # ------------------------------------------------------------------ building the plan
    def _matrices(self, model, layers, weights: DerivedWeights, q8: bool) -> tuple:
        """(per-name matrix tuples, embed, head) as the C step reads them: fp32 weights holding only
        16-bit values and q4_1 / q8_0 / q5_0 / q5_1 blocks from the copies `weights` makes once (their
        originals join self.sources). Prompt blocks in fp32 activations read the same regrouped blocks
        (kernels.c decodes T_Q4_1R / T_Q8_0R / T_Q5R to the values the stored blocks hold), so the native
        path never reads a regrouped matrix's original blocks again (DerivedWeights drops their pages)."""
        # the regrouped kernels are q8 dots
        grouped = weights.regroup_on and q8 and bool(self.library.gen_has_q4_1r())
        if grouped:   # the model's own q4_1 / q8_0 copies (fused q/k/v) held grouped: no second copy here
            mods = [m for m in [layer[i] for layer in layers for i in (1, 2, 4, 5)] + [model.lm_head]
                    if isinstance(m, QuantLinear) and not m.grouped]
            if sum(m.group() for m in mods):
                trim_heap()   # the stored-layout blocks just freed go back to the kernel
        mats = {n: [matrix(layer[i]) for layer in layers] for i, n in ((1, "qkv"), (2, "wo"), (4, "gu"), (5, "wd"))}
        embed, head = matrix(model.embed_tokens), matrix(model.lm_head)
        originals = [m for ms in mats.values() for m in ms] + [embed, head]
        mats = {n: [weights.narrow(m, grouped, q8) for m in ms] for n, ms in mats.items()}
        # a tied lm_head reads the embedding's very blocks (the stack holds them flat)
        tied = embed[1] == head[1] and (embed[0].data_ptr(), embed[0].numel()) == (head[0].data_ptr(), head[0].numel())
        embed, head = weights.narrow(embed, grouped, q8), weights.narrow(head, grouped, q8)
        if tied and head[0] is not embed[0]:   # the head reads a regrouped copy: the embedding's rows too
            embed = head[:4]                   # (row_to_f32 decodes them as stored), never the map again
        used = [m[0] for ms in mats.values() for m in ms] + [embed[0], head[0]]
        self.sources += [o[0] for o, u in zip(originals, used) if u is not o[0]]
        # Qwen2's q/k/v biases as fp32 (copies when the model's are not: checked like every copy)
        biases = [layer[1].bias for layer in layers] if layers and layers[0][1].bias is not None else None
        self.biases = None
        if biases is not None:
            self.biases = [b.detach().float().contiguous() for b in biases]
            self.sources += [b.detach() for b, c in zip(biases, self.biases) if c.data_ptr() != b.data_ptr()]
        return mats, embed, head

    @staticmethod
    def _norms(model, layers) -> tuple:
        """(every norm weight, Qwen3's per-layer (q norms, k norms) or None, their gen.h type code)."""
        attns = [b.self_attn for b in model.layers]
        qk_norms = ([a.q_norm.weight for a in attns], [a.k_norm.weight for a in attns]) \
            if attns and attns[0].q_norm is not None else None
        norms = [layer[i] for layer in layers for i in (0, 3)] + [model.norm.weight] + \
            ([w for ws in qk_norms for w in ws] if qk_norms else [])
        return norms, qk_norms, TYPES.get(model.norm.weight.dtype, -1)

    def _decay_copies(self, lin) -> None:
        """A learned decay's factors exp(FeatureMap.decay), every layer's, computed once per plan: a
        copy, so the logits behind it are checked for in-place edits as the other copied weights are
        (gated: fp32 copies of the logits and the gate, the factors computed per token in C)."""
        self.decay = self.gate = None
        fm = lin.feature_map if lin is not None else None
        if fm is not None and fm.has_gate:
            self.gate = [fm.decay_logit.detach().float().contiguous(), fm.gate_weight.detach().float().contiguous()]
            self.sources += [fm.decay_logit.detach(), fm.gate_weight.detach()]
        elif fm is not None and fm.has_decay:
            self.decay = fm.decay(slice(None)).detach().float().exp().contiguous()
            self.sources.append(fm.decay_logit.detach())

    def _tables(self, L: int, mats: dict, layers, qk_norms) -> None:
        """The per-layer pointer tables the Plan points at (kept alive here, with Mat.rest chains)."""
        self.chains = []   # the segments of stacked matrices (Mat.rest): alive as long as the plan
        self.tables = {n: (Mat * L)(*[mat(m, self.chains) for m in ms]) for n, ms in mats.items()}
        self.norm_tables = {n: (_V * L)(*[layer[i].data_ptr() for layer in layers])
                            for i, n in ((0, "ln1"), (3, "ln2"))}
        if qk_norms is not None:
            self.norm_tables.update({n: (_V * L)(*[w.data_ptr() for w in ws])
                                     for n, ws in zip(("q_norm", "k_norm"), qk_norms)})
        if self.biases is not None:
            self.bias_table = (_P * L)(*[ptr(b) for b in self.biases])

    def _state_fields(self, state, kv, lin, maps: list, q8: bool) -> dict:
        """The Plan fields of the state (cache, linear state, window, hybrid layer tables), the
        learned maps and decay, and the biases."""
        mode = MODES[lin.feature_map.name] if lin is not None else 0
        D = self.model.config.head_dim
        fields = dict(mode=mode, F=lin.feature_map.out_dim(D) if lin is not None else 0,
                      S_max=kv.max_len if kv is not None else 0, linear_rope=int(self.model.config.linear_rope),
                      q8_acts=int(q8))
        if lin is not None:
            fields.update(S=ptr(lin.S), z=ptr(lin.z))
        self.sparse = lin if isinstance(lin, SparseWindowState) else None   # a plan serves one state
        if self.sparse is not None:   # W stays 0: the recent keys are rk, rv
            self.sp_held = torch.zeros(self.cache_rows, dtype=torch.int32)
            fields.update(rk=lin.rk.data_ptr(), rv=lin.rv.data_ptr(), ck=lin.ck.data_ptr(), cv=lin.cv.data_ptr(),
                          cuse=lin.cuse.data_ptr(), sp_held=self.sp_held.data_ptr(), R=lin.rk.shape[3],
                          M=lin.ck.shape[3], w_type=TYPES[lin.rk.dtype])
        elif lin is not None and lin.path == "window":
            fields.update(wk=lin.wk.data_ptr(), wv=lin.wv.data_ptr(), w_type=TYPES[lin.wk.dtype], W=lin.window,
                          wreal=lin.wreal.data_ptr())
        if kv is not None:
            fields.update(k=kv.k.data_ptr(), v=kv.v.data_ptr(), kv_type=TYPES[kv.k.dtype])
            if self.cache_rows != state.batch_size:   # the first B rows of a cache with spare rows
                fields.update(Bc=self.cache_rows, seq=-1)
        if maps:
            fields.update({n: t.data_ptr() for n, t in zip(("hq_w", "hq_b", "hk_w", "hk_b"), maps)},
                          hh_type=TYPES[maps[0].dtype])
        if self.gate is not None:
            fields.update(hh_logit=ptr(self.gate[0]), hh_gate=ptr(self.gate[1]))
        elif self.decay is not None:
            fields.update(hh_decay=ptr(self.decay))
        if self.biases is not None:
            fields.update(qkv_bias=self.bias_table)
        if state.path == "hybrid":   # per model layer: its mode, and its layer inside its part
            self.layer_mode = (ctypes.c_int * len(state.where))(
                *[0 if p == "softmax" else mode for p in state.layer_paths])
            self.layer_index = (ctypes.c_int * len(state.where))(*[j for _, j in state.where])
            fields.update(layer_mode=self.layer_mode, layer_index=self.layer_index)
        return fields

    def __del__(self):
        for plan, ref in ((getattr(self, "plan", None), getattr(self, "plan_ref", None)),
                          (getattr(self, "prefill_plan", None), getattr(self, "prefill_ref", None))):
            if ref is not None and plan.tscratch:
                self.library.gen_plan_free(ref)   # waits until no pool worker is inside this plan's chunks
        if getattr(self, "prefill_plan", None) is not None:
            self.prefill_scratch = None
            trim_heap(when_freed=True)   # a prompt plan's scratch (its rows x the vocabulary per thread) goes back

    def _prefill_plan(self):
        """The decode plan's twin for prompt blocks: PREFILL_ROWS rows of scratch, the same weights
        and state; row r is token r of one sequence's block (gen_prefill_block)."""
        if self.prefill_plan is None:
            self.prefill_scratch = {n: torch.zeros(PREFILL_ROWS, size) for n, size in self.widths}
            plan = Plan()
            ctypes.memmove(ctypes.byref(plan), self.plan_ref, ctypes.sizeof(Plan))   # every field, then rows and scratch
            plan.tscratch, plan.tscratch_floats = None, 0
            plan.B, plan.Bc, plan.seq = PREFILL_ROWS, self.cache_rows, 0
            plan.q8_acts = int(self.q8_prompt)
            for n, t in self.prefill_scratch.items():
                setattr(plan, n, ptr(t))
            ref = ctypes.byref(plan)
            if self.library.gen_plan_init(ref) != 0:
                raise NativeUnavailableError("the native step could not allocate its thread scratch")
            self.prefill_plan, self.prefill_ref = plan, ref
        return self.prefill_ref

    # ------------------------------------------------------------------ checks before every step
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

    # ------------------------------------------------------------------ running it
    def prefill(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (B, T), no pads, on a state without pads -> the last position's logits (B, 1, V);
        writes T cache slots per row (or T linear updates) and advances the state."""
        pieces = self.prefill_pieces(tokens, state, layers=self.L)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value

    def prefill_pieces(self, tokens: torch.Tensor, state, layers: int = 1, head: bool = True):
        """`prefill` in pieces of `layers` layers: a generator that yields after each piece and
        returns prefill's logits (StopIteration.value), bit for bit (the residual stream waits in the
        prefill plan's scratch between pieces). Until it returns, the state is open: nothing else may
        step it (the server's scheduler decodes other states between pieces). head=False: a block
        whose logits nobody reads (not a prompt's last): the output layer is skipped, None returned."""
        span = state.open(tokens)            # shape and capacity checks, as PyTorch
        B, T = tokens.shape
        ids = tokens.to(torch.int64).contiguous()
        flat = ids.flatten().tolist()
        lo, hi = min(flat), max(flat)
        if lo < 0 or hi >= self.V:
            raise IndexError(f"token id {lo if lo < 0 else hi} outside the vocabulary (0..{self.V - 1})")
        ref = self._prefill_plan()
        cos = sin = None
        if self.rope:
            cos, sin = self.model.rotary.table(span.start + T, tokens.device, torch.float32)   # (S, D)
        logits = torch.empty(B, 1, self.V)
        row_bytes = 8 * T
        sparse = self.sparse   # its blocks split at the rows' decisions, which run in between
        for b in range(B):
            t0 = 0
            while t0 < T:
                n = min(PREFILL_ROWS, T - t0)
                if sparse is not None:
                    pos = int(sparse.lengths[b]) + t0
                    n = min(n, SPARSE_BLOCK - pos % SPARSE_BLOCK)
                    self.sp_held[b] = held(pos, sparse.window)
                slot = span.start + t0
                rope = (None, None) if cos is None else (cos[slot].data_ptr(), sin[slot].data_ptr())
                out = logits[b].data_ptr() if head and t0 + n == T else None   # the head for the last block only
                for l0 in range(0, self.L, layers):
                    self.prefill_plan.seq = b
                    self.library.gen_prefill_layers(ref, PREFILL_ROWS, n, ids.data_ptr() + b * row_bytes + 8 * t0,
                                                    slot, *rope, None, out, l0, min(l0 + layers, self.L))
                    yield
                if sparse is not None and (pos + n) % SPARSE_BLOCK == 0:
                    sparse.decide_at(b, pos + n)
                t0 += n
        state.commit(span)
        return logits if head else None

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
        kv = state_parts(state)[0] if padded else None
        if kv is not None:
            real = kv.slot_real.data_ptr()   # (B, S_max) bool, one byte each
        logits = torch.empty(self.B, 1, self.V)
        sparse = self.sparse
        if sparse is not None:
            before = sparse.lengths.clone()
            self.sp_held[:self.B].copy_(sparse.held_counts())
        self.library.gen_decode_step(self.plan_ref, ids.data_ptr(), span.start, cos, sin, stride, real,
                                     logits.data_ptr())
        state.commit(span)
        if sparse is not None:
            sparse.decide_rows(before)
        return logits

