"""Sliding window + a sparse cache of hard keys + linear attention (LoLA's three memories, McDermott
et al. 2025, arXiv 2505.23666): `--sparse-keys M` on a window run.

A key that leaves the window does not always go into the linear state: per layer and key/value head
the M keys the state would serve worst stay exact. Each query attends, in one normalisation, exactly
to the window and to the cached keys, and through the linear state to every other older key:

    a_j = exp(q.k_j / sqrt(D) - m)   for the window's keys and the cached ones (m: their max score)
    b_j = phi(q) . phi(k_j)          for the keys in S, z
    out = (sum_j a_j v_j + phi(q)^T S) / (sum_j a_j + phi(q)^T z + EPS)

Which keys stay is decided every BLOCK (64) tokens of a sequence's own positions, so a prompt read in
one block, in chunks, or a token at a time makes the same choices, and a row decides alone whatever
its neighbours in a batch: at position e (a multiple of BLOCK) the keys that left the window since
the last decision and the M cached ones are scored by their self-recall error against the state

    err_j = || v_j - S^T phi(k_j) / (z . phi(k_j) + EPS) ||

(how far the state would recall v_j from k_j, rounded to 3 decimals; among equal errors the later
candidate wins); the M largest stay cached, the rest are folded into S and z. Between decisions a query sees the keys (b - W, t] exactly (b: the last decision's position,
W the window: W to W + BLOCK - 1 keys, its own included), the cached ones and the state.

State per layer: S (B, Hkv, F, Dv) and z (B, Hkv, F) fp32; the recent keys and values (B, Hkv,
W + BLOCK - 1, D), right-aligned, how many are held follows from the row's length; the cache (B, Hkv,
M, D) keys and values with a mask of the slots in use (keys and values in the model's dtype; all
arithmetic in fp32). Constant in the context. Maps with a learned decay decay S and z at every token,
S_t = diag(g_t) S_{t-1} (as the window form, engine/attention/window.py: a key decays from the moment
it is folded in, at a decision; a cached key does not decay). Rows run one at a time (their
decisions fall at different slots when rows are padded differently).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import State, take_rows
from engine.attention.feature_maps import FeatureMap, state_dtype
from engine.attention.linear import EPS, as_feature_map, fp32_under_autocast
from engine.attention.packed import Packed
from engine.attention.window import saved_state

BLOCK = 64   # tokens between two decisions of what the cache keeps
NEG = float("-inf")
ERR_DECIMALS = 3   # self-recall errors compare rounded to this many decimals (ties: the later candidate)


def held(n: int, window: int) -> int:
    """Recent keys a row holds after `n` tokens: those after the last decision's window, (b - W, n)."""
    b = n - n % BLOCK
    return n - max(b - window + 1, 0)


@dataclass
class Memory:
    """One row's memory for one layer (views into the state, or fresh tensors for the stateless form)."""
    S: torch.Tensor        # (Hkv, F, Dv) fp32
    z: torch.Tensor        # (Hkv, F)
    rk: torch.Tensor       # (Hkv, h, D) the recent keys, oldest first (fp32)
    rv: torch.Tensor
    ck: torch.Tensor       # (Hkv, M, D) cached keys (fp32)
    cv: torch.Tensor
    cuse: torch.Tensor     # (Hkv, M) bool


def row_attention(q, k, v, n: int, mem: Memory, fmap, layer, window: int):
    """One row's block: q (H, T, D), k, v (Hkv, T, D), its real tokens at positions n.. n+T-1;
    `mem` holds the row before them and is replaced by the row after them. Returns (H, T, Dv) fp32."""
    H, T, D = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    sd = mem.S.dtype
    qs = (q.to(sd) * D ** -0.5).view(Hkv, G, T, D)
    phi_q = fmap(q[None], layer, "q")[0].view(Hkv, G, T, -1)
    k, v = k.to(sd), v.to(sd)
    ld = fmap.decay(layer, v[None])                                           # None, (Hkv, F) or (1, Hkv, T, F)
    if ld is not None:
        ld = ld[0] if ld.dim() == 4 else ld[:, None].expand(-1, T, -1)        # (Hkv, T, F)
    outs, t = [], 0
    while t < T:
        pos = n + t
        end = pos - pos % BLOCK + BLOCK
        m = min(T - t, end - pos)
        keys, values = torch.cat([mem.rk, k[:, t:t + m]], 1), torch.cat([mem.rv, v[:, t:t + m]], 1)
        h = mem.rk.shape[1]
        qc = qs[:, :, t:t + m]                                                # (Hkv, G, m, D)
        sc = qc @ keys[:, None].transpose(-1, -2)                             # (Hkv, G, m, h + m)
        causal = torch.arange(h + m, device=q.device)[None, :] <= torch.arange(h, h + m, device=q.device)[:, None]
        sc = sc.masked_fill(~causal, NEG)
        cs = (qc @ mem.ck[:, None].transpose(-1, -2)).masked_fill(~mem.cuse[:, None, None, :], NEG)
        scores = torch.cat([sc, cs], -1)
        a = torch.exp(scores - scores.amax(-1, keepdim=True))
        pq = phi_q[:, :, t:t + m]                                             # (Hkv, G, m, F)
        if ld is not None:   # query t reads the state decayed by the tokens up to its own
            c = ld[:, t:t + m].cumsum(1)                                      # (Hkv, m, F)
            pq = pq * c.exp()[:, None]
            carry = c[:, -1].exp()                                            # (Hkv, F)
        num = a[..., :h + m] @ values[:, None] + a[..., h + m:] @ mem.cv[:, None] + pq @ mem.S[:, None]
        den = a.sum(-1, keepdim=True) + pq @ mem.z[:, None, :, None]
        outs.append((num / (den + EPS)).reshape(H, m, -1))
        if ld is not None:
            mem.S, mem.z = carry[..., None] * mem.S, carry * mem.z
        mem.rk, mem.rv = keys, values
        t += m
        if pos + m == end:
            decide(mem, end, fmap, layer, window)
    return torch.cat(outs, 1)


def decide(mem: Memory, e: int, fmap, layer, window: int) -> None:
    """At position e (a multiple of BLOCK): the recent keys that leave the window compete with the
    cached ones by self-recall error; the M worst served stay, the rest go into S, z."""
    leave = mem.rk.shape[1] - held(e, window)
    if leave <= 0:
        return
    ek, ev = mem.rk[:, :leave], mem.rv[:, :leave]
    mem.rk, mem.rv = mem.rk[:, leave:], mem.rv[:, leave:]
    M = mem.ck.shape[1]
    cand_k, cand_v = torch.cat([mem.ck, ek], 1), torch.cat([mem.cv, ev], 1)       # (Hkv, M + n, D)
    use = torch.cat([mem.cuse, mem.cuse.new_ones(ek.shape[:2])], 1)
    pk = fmap(cand_k[None], layer, "k")[0]                                       # (Hkv, M + n, F)
    recall = (pk @ mem.S) / (pk @ mem.z[..., None] + EPS)
    err = torch.round((cand_v - recall).norm(dim=-1), decimals=ERR_DECIMALS).masked_fill(~use, -1.0)
    # the M largest errors; among equal ones the later candidate (a leaving key before a cached one, the
    # newer of two leaving ones): repeated tokens have equal values in the first layer, and the step
    # forms, whose values differ in the last bits, must pick the same keys
    n = err.shape[-1]
    keep = (n - 1) - torch.sort(err.flip(-1), dim=-1, descending=True, stable=True).indices[:, :M]
    kept = torch.zeros_like(use).scatter_(1, keep, True) & use
    fold = (use & ~kept).to(pk.dtype)[..., None]
    mem.S = mem.S + (pk * fold).transpose(-1, -2) @ cand_v
    mem.z = mem.z + (pk * fold).sum(1)
    idx = keep[..., None].expand(-1, -1, cand_k.shape[-1])
    mem.ck, mem.cv = torch.gather(cand_k, 1, idx), torch.gather(cand_v, 1, idx)
    mem.cuse = torch.gather(use, 1, keep)


def empty_memory(Hkv: int, F_: int, D: int, M: int, device, sd) -> Memory:
    z = torch.zeros
    return Memory(z(Hkv, F_, D, device=device, dtype=sd), z(Hkv, F_, device=device, dtype=sd),
                  z(Hkv, 0, D, device=device, dtype=sd), z(Hkv, 0, D, device=device, dtype=sd),
                  z(Hkv, M, D, device=device, dtype=sd), z(Hkv, M, D, device=device, dtype=sd),
                  torch.zeros(Hkv, M, dtype=torch.bool, device=device))


@dataclass(eq=False)
class SparseWindowState(State):
    S: torch.Tensor = None          # (L, B, Hkv, F, Dv) fp32: keys neither recent nor cached
    z: torch.Tensor = None          # (L, B, Hkv, F) fp32
    rk: torch.Tensor = None         # (L, B, Hkv, W + BLOCK - 1, D) recent keys, right-aligned (model dtype)
    rv: torch.Tensor = None
    ck: torch.Tensor = None         # (L, B, Hkv, M, D) the cached keys (model dtype)
    cv: torch.Tensor = None
    cuse: torch.Tensor = None       # (L, B, Hkv, M) bool: cache slot in use
    window: int = 0
    feature_map: FeatureMap = None
    layer_ids: tuple[int, ...] | None = None

    path = "window"
    max_len = None

    @classmethod
    def allocate(cls, cfg, batch: int, max_len, device, dtype, feature_map=None, layers=None,
                 window: int = 0, sparse_keys: int = 0) -> "SparseWindowState":
        fmap = as_feature_map(feature_map or cfg.feature_map)
        F_, D, Hkv = fmap.out_dim(cfg.head_dim), cfg.head_dim, cfg.num_key_value_heads
        L = cfg.num_hidden_layers if layers is None else len(layers)
        sd, z = state_dtype(dtype), torch.zeros
        R = window + BLOCK - 1
        return cls(lengths=torch.zeros(batch, dtype=torch.long, device=device), slots=0,
                   S=z(L, batch, Hkv, F_, D, device=device, dtype=sd), z=z(L, batch, Hkv, F_, device=device, dtype=sd),
                   rk=z(L, batch, Hkv, R, D, device=device, dtype=dtype), rv=z(L, batch, Hkv, R, D, device=device, dtype=dtype),
                   ck=z(L, batch, Hkv, sparse_keys, D, device=device, dtype=dtype),
                   cv=z(L, batch, Hkv, sparse_keys, D, device=device, dtype=dtype),
                   cuse=torch.zeros(L, batch, Hkv, sparse_keys, dtype=torch.bool, device=device),
                   window=window, feature_map=fmap, layer_ids=None if layers is None else tuple(layers))

    @property
    def sparse_keys(self) -> int:
        return self.ck.shape[3]

    def tensors(self):
        return [self.S, self.z, self.rk, self.rv, self.ck, self.cv]

    def packed(self) -> Packed:
        """The recent keys the rows hold (`held`); S, z and the sparse cache unless all zero (no key
        folded or kept yet)."""
        n = int(self.held_counts().max()) if self.batch_size else 0
        return Packed(self, tails={"rk": (3, n), "rv": (3, n)}, elide=("S", "z", "ck", "cv", "cuse"))

    def identity(self) -> dict:
        L, _, Hkv, F_, Dv = self.S.shape
        return {"path": self.path, "layers": L, "kv_heads": Hkv, "features": F_, "head_dim": Dv,
                "window": self.window, "sparse_keys": self.sparse_keys, "feature_map": self.feature_map.name,
                "layer_ids": None if self.layer_ids is None else list(self.layer_ids),
                "dtype": str(self.S.dtype).removeprefix("torch."),
                "window_dtype": str(self.rk.dtype).removeprefix("torch.")}

    NAMES = ("S", "z", "rk", "rv", "ck", "cv", "cuse")

    def _saved_tensors(self):
        return {n: getattr(self, n) for n in self.NAMES}

    def _load_tensors(self, tensors, slots):
        for n in self.NAMES:
            getattr(self, n).copy_(tensors[n])

    def _rows(self, lengths, *tensors) -> "SparseWindowState":
        out = SparseWindowState(lengths=lengths, slots=0, **dict(zip(self.NAMES, tensors)), window=self.window,
                                feature_map=self.feature_map, layer_ids=self.layer_ids)
        out.slots = int(lengths.max()) if len(lengths) else 0
        out._after_regroup()
        return out

    def select_rows(self, idx, max_len=None) -> "SparseWindowState":
        idx = [int(i) for i in idx]
        return self._rows(take_rows(self.lengths, idx, 0), *(take_rows(getattr(self, n), idx, 1) for n in self.NAMES))

    @classmethod
    def concat(cls, states, max_len=None) -> "SparseWindowState":
        cls.check_same_identity(states, "shapes, windows, caches, dtypes or feature maps")
        return states[0]._rows(torch.cat([s.lengths for s in states]),
                               *(torch.cat([getattr(s, n) for s in states], 1) for n in cls.NAMES))

    @classmethod
    def from_state_dict(cls, sd, max_len: int | None = None, device=None, feature_map=None) -> "SparseWindowState":
        return saved_state(cls, sd, cls.NAMES, device, feature_map, window=int(sd["meta"]["window"]))

    def attend(self, layer: int, q, k, v, span):
        """q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, D) in q's dtype; pads get zeros."""
        B, H, T, D = q.shape
        out = q.new_zeros(B, H, T, self.rv.shape[-1])
        for b in range(B):
            real = slice(None) if span.real is None else span.real[b]
            qb, kb, vb = q[b][:, real], k[b][:, real], v[b][:, real]
            if qb.shape[1] == 0:
                continue
            n = int(self.lengths[b])
            mem = self._memory(layer, b, held(n, self.window))
            o = row_attention(qb, kb, vb, n, mem, self.feature_map, self._model_layer(layer), self.window)
            out[b][:, real] = o.to(q.dtype)
            self._store(layer, b, mem)
        return out

    def held_counts(self) -> torch.Tensor:
        """(B,) int32: the recent keys each row holds now (what the C step reads before a token)."""
        n = self.lengths
        return (n - (n - n % BLOCK - self.window + 1).clamp(min=0)).to(torch.int32)

    def decide_rows(self, before: torch.Tensor) -> None:
        """The decisions a one-token step left to its caller (the C step appends keys but folds none):
        every row whose length went from `before` to a multiple of BLOCK decides, in every layer, as
        `attend` would have."""
        crossed = (self.lengths % BLOCK == 0) & (self.lengths == before + 1)
        for b in [int(i) for i in torch.nonzero(crossed).flatten()]:
            self.decide_at(b, int(self.lengths[b]))

    @torch.no_grad()
    def decide_at(self, b: int, e: int) -> None:
        """Row b's decision at its position e (a multiple of BLOCK), in every layer, its recent keys
        appended up to e (a C step or a native prompt block left it). Without autograd whatever the
        caller's mode (a server's loop thread has it on): learned maps' parameters would otherwise hang
        the decision's activations on S and z, kept as long as the state (a prefix cache entry of a
        1,000-token prompt held ~100 MB more than its tensors)."""
        for layer in range(self.S.shape[0]):
            mem = self._memory(layer, b, min(e, self.window + BLOCK - 1))
            decide(mem, e, self.feature_map, self._model_layer(layer), self.window)
            self._store(layer, b, mem)

    def _model_layer(self, layer: int) -> int:
        return layer if self.layer_ids is None else self.layer_ids[layer]

    def _memory(self, layer: int, b: int, h: int) -> Memory:
        """Row b's memory in layer `layer` (fp32 copies), its newest h recent keys held."""
        R, sd = self.rk.shape[3], self.S.dtype
        return Memory(self.S[layer, b], self.z[layer, b], self.rk[layer, b, :, R - h:].to(sd),
                      self.rv[layer, b, :, R - h:].to(sd), self.ck[layer, b].to(sd), self.cv[layer, b].to(sd),
                      self.cuse[layer, b])

    def _store(self, layer: int, b: int, mem: Memory) -> None:
        R, h = self.rk.shape[3], mem.rk.shape[1]
        self.S[layer, b].copy_(mem.S)
        self.z[layer, b].copy_(mem.z)
        self.rk[layer, b, :, R - h:].copy_(mem.rk)
        self.rv[layer, b, :, R - h:].copy_(mem.rv)
        self.ck[layer, b].copy_(mem.ck)
        self.cv[layer, b].copy_(mem.cv)
        self.cuse[layer, b].copy_(mem.cuse)


@fp32_under_autocast
def sparse_window_attention(q, k, v, fmap, window: int, sparse_keys: int, valid=None, layer: int | None = None):
    """Stateless full-sequence form (evaluation): each row from an empty memory, its real tokens only.
    q (B, H, T, D); k, v (B, Hkv, T, D); valid (B, T) bool or None -> (B, H, T, D)."""
    B, H, T, D = q.shape
    fmap = as_feature_map(fmap)
    sd = state_dtype(q.dtype)
    F_ = fmap.out_dim(D)
    out = q.new_zeros(B, H, T, v.shape[-1])
    for b in range(B):
        real = slice(None) if valid is None else valid[b]
        mem = empty_memory(k.shape[1], F_, D, sparse_keys, q.device, sd)
        out[b][:, real] = row_attention(q[b][:, real], k[b][:, real], v[b][:, real], 0, mem, fmap, layer,
                                        window).to(q.dtype)
    return out
