"""Sliding window + linear attention (LoLCATs' form, Zhang et al. 2024, arXiv 2410.10254).

Each query attends exactly (softmax scores) to the last W keys, its own included, and through
the linear state to every older key, in one normalisation:

    a_j = exp(q.k_j / sqrt(D) - m)   for the W newest keys j (m: their max score)
    b_j = phi(q) . phi(k_j)          for every older key j (held in S, z)
    out = (sum_j a_j v_j + phi(q)^T S) / (sum_j a_j + phi(q)^T z + EPS)

The state is constant in the context: per layer the W newest keys and values (model dtype) plus
S (B, Hkv, F, Dv) and z (B, Hkv, F) in fp32 of the keys that left the window. A key enters S when
it leaves the window. Maps with a learned decay (`gen linearize --decay` / `--gate`) decay the state
from the moment a key enters it: at each real token t, S_t = diag(g_t) S_{t-1} + phi(k_{t-W}) v_{t-W}^T
(z alike), g_t = exp(FeatureMap.decay) (gated: read from token t's value), so a key's weight in the
state is the product of the factors of the tokens since it left the window. Windows count slots:
pads only come first (left-padded prompt blocks), are masked out of the scores and zeroed out of S
(and decay nothing), so a padded row sees the keys it would see alone.

One code path serves prefill and decode: the W buffered keys are put before the block's T keys
(index j in 0..W+T-1); query t (key index W+t) sees keys (t, t+W] exactly and keys 0..t plus S
through phi, which is ordinary causal linear attention between q_t and key t of that
concatenation (`linear_chunk`; with a decay, the block tokens', `decayed_parts`); the window part is
computed per chunk of queries against the C + W - 1 keys it can see, so prefill costs O(T (C + W)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import State, take_rows
from engine.attention.feature_maps import FeatureMap, get_feature_map, state_dtype
from engine.attention.linear import (CHUNK, EPS, as_feature_map, decayed_parts, fp32_under_autocast, linear_chunk,
                                     stateless_chunk, token_decay)
from engine.attention.packed import Packed

NEG = float("-inf")


@dataclass(eq=False)
class WindowState(State):
    S: torch.Tensor = None          # (L, B, Hkv, F, Dv) fp32: keys older than the window
    z: torch.Tensor = None          # (L, B, Hkv, F) fp32
    wk: torch.Tensor = None         # (L, B, Hkv, W, D) the W newest keys, oldest first (model dtype)
    wv: torch.Tensor = None         # (L, B, Hkv, W, D)
    wreal: torch.Tensor = None      # (B, W) bool: buffer slot holds a real key (False: pad or empty)
    feature_map: FeatureMap = None
    layer_ids: tuple[int, ...] | None = None

    path = "window"
    max_len = None

    @classmethod
    def allocate(cls, cfg, batch: int, max_len, device, dtype, feature_map=None, layers=None,
                 window: int = 0) -> "WindowState":
        fmap = as_feature_map(feature_map or cfg.feature_map)
        F_, D, Hkv = fmap.out_dim(cfg.head_dim), cfg.head_dim, cfg.num_key_value_heads
        L = cfg.num_hidden_layers if layers is None else len(layers)
        sd = state_dtype(dtype)
        return cls(lengths=torch.zeros(batch, dtype=torch.long, device=device), slots=0,
                   S=torch.zeros(L, batch, Hkv, F_, D, device=device, dtype=sd),
                   z=torch.zeros(L, batch, Hkv, F_, device=device, dtype=sd),
                   wk=torch.zeros(L, batch, Hkv, window, D, device=device, dtype=dtype),
                   wv=torch.zeros(L, batch, Hkv, window, D, device=device, dtype=dtype),
                   wreal=torch.zeros(batch, window, dtype=torch.bool, device=device),
                   feature_map=fmap, layer_ids=None if layers is None else tuple(layers))

    @property
    def window(self) -> int:
        return self.wk.shape[3]

    def tensors(self):
        return [self.S, self.z, self.wk, self.wv]

    def packed(self) -> Packed:
        """The window's slots from the first one any row holds a real key in, S and z unless zero."""
        real = self.wreal.any(0)
        n = int(self.window - real.int().argmax()) if bool(real.any()) else 0
        return Packed(self, tails={"wk": (3, n), "wv": (3, n), "wreal": (1, n)}, elide=("S", "z"))

    # ------------------------------------------------------------------ saving and batching
    def identity(self) -> dict:
        L, _, Hkv, F_, Dv = self.S.shape
        return {"path": self.path, "layers": L, "kv_heads": Hkv, "features": F_, "head_dim": Dv,
                "window": self.window, "feature_map": self.feature_map.name,
                "layer_ids": None if self.layer_ids is None else list(self.layer_ids),
                "dtype": str(self.S.dtype).removeprefix("torch."),
                "window_dtype": str(self.wk.dtype).removeprefix("torch.")}

    def _saved_tensors(self):
        return {"S": self.S, "z": self.z, "wk": self.wk, "wv": self.wv, "wreal": self.wreal}

    def _load_tensors(self, tensors, slots):
        for name in ("S", "z", "wk", "wv", "wreal"):
            getattr(self, name).copy_(tensors[name])

    def _rows(self, lengths, S, z, wk, wv, wreal) -> "WindowState":
        # each row's window holds its own newest W slots (pads masked by wreal), whatever the other rows
        # hold, so rows regroup freely; `slots` only sets the rotary positions of unpadded batches
        out = WindowState(lengths=lengths, slots=0, S=S, z=z, wk=wk, wv=wv, wreal=wreal,
                          feature_map=self.feature_map, layer_ids=self.layer_ids)
        out.slots = int(lengths.max()) if len(lengths) else 0
        out._after_regroup()
        return out

    def select_rows(self, idx, max_len=None) -> "WindowState":
        idx = [int(i) for i in idx]
        return self._rows(take_rows(self.lengths, idx, 0),
                          *(take_rows(getattr(self, n), idx, 1) for n in ("S", "z", "wk", "wv")),
                          take_rows(self.wreal, idx, 0))

    @classmethod
    def concat(cls, states, max_len=None) -> "WindowState":
        cls.check_same_identity(states, "shapes, windows, dtypes or feature maps")
        return states[0]._rows(torch.cat([s.lengths for s in states]),
                               *(torch.cat([getattr(s, n) for s in states], 1) for n in ("S", "z", "wk", "wv")),
                               torch.cat([s.wreal for s in states]))

    @classmethod
    def from_state_dict(cls, sd, max_len: int | None = None, device=None, feature_map=None) -> "WindowState":
        """A new state from `state_dict()` output (`max_len` is ignored: the state does not grow).
        feature_map: the map object to run (a model's learned maps); default: the fixed map saved by name."""
        return saved_state(cls, sd, ("S", "z", "wk", "wv", "wreal"), device, feature_map)

    def attend(self, layer: int, q, k, v, span):
        """q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, D) in q's dtype."""
        model_layer = layer if self.layer_ids is None else self.layer_ids[layer]
        B, T = q.shape[0], span.length
        real = span.real if span.real is not None else self.wreal.new_ones(B, T)
        keys = torch.cat([self.wk[layer], k], 2)                       # (B, Hkv, W+T, D)
        values = torch.cat([self.wv[layer], v], 2)
        key_real = torch.cat([self.wreal, real], 1)                    # (B, W+T)
        out, S, z = window_linear_attention(q, keys, values, key_real, self.feature_map, model_layer,
                                            self.S[layer], self.z[layer])
        self.S[layer].copy_(S)
        self.z[layer].copy_(z)
        self.wk[layer].copy_(keys[:, :, T:])
        self.wv[layer].copy_(values[:, :, T:])
        return out

    def commit(self, span):
        real = span.real if span.real is not None else self.wreal.new_ones(self.batch_size, span.length)
        self.wreal.copy_(torch.cat([self.wreal, real], 1)[:, span.length:])
        super().commit(span)


def saved_state(cls, sd, names, device=None, feature_map=None, **fields):
    """A `cls` state (batch and layers as saved) from `state_dict()` output: its tensors `names`, the
    feature map (`feature_map`, else the fixed one saved by name), `fields`; loaded and checked."""
    t, meta = sd["tensors"], sd["meta"]
    device = device or t["S"].device
    ids = meta.get("layer_ids")
    out = cls(lengths=torch.zeros(t["S"].shape[1], dtype=torch.long, device=device), slots=0,
              **{n: torch.zeros_like(t[n], device=device) for n in names},
              feature_map=feature_map or get_feature_map(meta["feature_map"]),
              layer_ids=None if ids is None else tuple(ids), **fields)
    out.load_state_dict(sd)
    return out


def window_linear_attention(q, keys, values, key_real, fmap, layer, S, z, chunk: int = CHUNK):
    """The block form. q (B, H, T, D); keys, values (B, Hkv, W+T, D): the W buffered keys then the
    block's T; key_real (B, W+T) bool; S (B, Hkv, F, Dv), z (B, Hkv, F) fp32 of the keys before them.

    Returns out (B, H, T, D) in q's dtype and the new (S, z) (the first T keys folded in, each block
    token's decay applied when the maps carry one); inputs are not modified.
    """
    B, H, T, D = q.shape
    Hkv, W = keys.shape[1], keys.shape[2] - T
    G = H // Hkv
    fmap = as_feature_map(fmap)
    sd = S.dtype
    phi_q = fmap(q, layer, "q").view(B, Hkv, G, T, -1)                        # (B, Hkv, G, T, F)
    k_lin = keys[:, :, :T]
    phi_k = fmap(k_lin, layer, "k") * key_real[:, None, :T, None]            # (B, Hkv, T, F)
    v_lin = values[:, :, :T].to(sd)
    ld = token_decay(fmap.decay(layer, values[:, :, W:].to(sd)), key_real[:, W:])   # None or (1|B, Hkv, 1|T, F)
    if ld is not None:   # the linear parts of every query at once (`decayed_parts`); the window's below
        lin_num, lin_den, S, z = decayed_parts(phi_q, phi_k, v_lin, S, z, ld)
    qs = (q.to(sd) * D ** -0.5).view(B, Hkv, G, T, D)
    ks, vs = keys.to(sd), values.to(sd)
    outs = []
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        C = e - s
        # linear part: q_t with keys 0..t of the concatenation, plus the carried S, z
        if ld is None:
            num, den, S, z = linear_chunk(phi_q[:, :, :, s:e], phi_k[:, :, s:e], v_lin[:, :, s:e], S, z)
        else:
            num, den = lin_num[:, :, :, s:e], lin_den[:, :, :, s:e]
        # window part: query t sees keys (t, t + W]; the chunk's queries see keys s+1 .. e+W-1
        kw, vw = ks[:, :, s + 1:e + W], vs[:, :, s + 1:e + W]                 # (B, Hkv, C+W-1, D)
        scores = qs[:, :, :, s:e] @ kw.unsqueeze(2).transpose(-1, -2)         # (B, Hkv, G, C, C+W-1)
        t = torch.arange(C, device=q.device)[:, None]
        r = torch.arange(C + W - 1, device=q.device)[None, :]
        band = (r >= t) & (r < t + W)                                         # (C, C+W-1)
        own = r == t + W - 1                                                  # the query's own key
        allowed = (band & key_real[:, None, s + 1:e + W]) | own               # (B, C, C+W-1)
        scores = scores.masked_fill(~allowed[:, None, None], NEG)
        a = torch.exp(scores - scores.amax(-1, keepdim=True))
        num = num + a @ vw.unsqueeze(2)
        den = den + a.sum(-1, keepdim=True)
        outs.append(num / (den + EPS))
    out = torch.cat(outs, dim=3).reshape(B, H, T, -1)
    return out.to(q.dtype), S, z


def window_linear_reference(q, k, v, fmap, window: int, valid=None, layer: int | None = None):
    """Plain-torch twin over a whole sequence from an empty state: explicit (T, T) weights.

    q (B, H, T, D); k, v (B, Hkv, T, D); valid (B, T) bool or None -> (B, H, T, D).
    """
    B, H, T, D = q.shape
    G = H // k.shape[1]
    fmap = as_feature_map(fmap)
    sd = state_dtype(q.dtype)
    valid = valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    phi_q = fmap(q, layer, "q")
    phi_k = (fmap(k, layer, "k") * valid[:, None, :, None]).repeat_interleave(G, 1)
    kk, vv = k.to(sd).repeat_interleave(G, 1), v.to(sd).repeat_interleave(G, 1)
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    in_window = (j <= i) & (j > i - window)
    older = j <= i - window
    scores = (q.to(sd) @ kk.transpose(-1, -2)) * D ** -0.5                   # (B, H, T, T)
    allowed = (in_window & valid[:, None, None, :]) | (i == j)
    scores = scores.masked_fill(~allowed, NEG)
    a = torch.exp(scores - scores.amax(-1, keepdim=True))
    ld = token_decay(fmap.decay(layer, v.to(sd)), valid)
    if ld is None:
        b = (phi_q @ phi_k.transpose(-1, -2)) * older
    else:   # key j entered the state at token j + W: weight e^{c_t - c_{j+W}}, c the cumulative log decay
        c = ld.expand(B, -1, T, -1).cumsum(2).repeat_interleave(G, 1)        # (B, H, T, F)
        never = c.new_full((B, H, min(window, T), c.shape[-1]), float("inf"))     # keys that never enter
        entered = torch.cat([c[:, :, window:], never], 2)[:, :, :T]                # c at the token key j enters
        w = (c[:, :, :, None, :] - entered[:, :, None, :, :]).masked_fill(~older[..., None], float("-inf")).exp()
        b = torch.einsum("bhtf,bhjf,bhtjf->bhtj", phi_q, phi_k, w)
    out = (a @ vv + b @ vv) / (a.sum(-1, keepdim=True) + b.sum(-1, keepdim=True) + EPS)
    return out.to(q.dtype)


@fp32_under_autocast
def window_attention(q, k, v, fmap, window: int, valid=None, layer: int | None = None):
    """Stateless full-sequence form (training, evaluation): the block form from an empty state."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    fmap = as_feature_map(fmap)
    F_ = fmap.out_dim(D)
    sd = state_dtype(q.dtype)
    pad_k = k.new_zeros(B, Hkv, window, D)
    valid = valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    key_real = torch.cat([valid.new_zeros(B, window), valid], 1)
    out, _, _ = window_linear_attention(q, torch.cat([pad_k, k], 2), torch.cat([pad_k, v], 2), key_real, fmap,
                                        layer, q.new_zeros(B, Hkv, F_, D, dtype=sd), q.new_zeros(B, Hkv, F_, dtype=sd),
                                        chunk=stateless_chunk(q))
    return out
