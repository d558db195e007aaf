"""Linear attention run as an RNN, with a chunked parallel form for prompt blocks.

    S_i = S_{i-1} + phi(k_i) v_i^T        S: (B, Hkv, F, Dv)
    z_i = z_{i-1} + phi(k_i)              z: (B, Hkv, F)
    out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + EPS)

A map may carry a learned decay (`FeatureMap.decay`, log decay ld (Hkv, F) <= 0, or a gated one
that depends on the token, ld_i (Hkv, F)): then S_i = diag(exp(ld_i)) S_{i-1} + phi(k_i) v_i^T and
z_i = exp(ld_i) * z_{i-1} + phi(k_i), still a constant-size state; pads neither add nor decay.

The state is kept in fp32 whatever the weights' dtype. With grouped-query attention the
state is per key/value head and shared by the query heads of its group, exactly like the KV
cache. No 1/sqrt(d) scale is applied: any scalar on phi(q) cancels between numerator and
denominator. Pads are masked after the feature map (elu+1 maps 0 to 1), so they leave S and
z untouched.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.attention.base import State, take_rows
from engine.attention.feature_maps import GATE_EPS, Elu1, FeatureMap, Hedgehog, get_feature_map, state_dtype
from engine.kernels import HedgehogLayer, linear_decode, linear_decode_elu1, linear_decode_hedgehog, why_not_hedgehog
from engine.kernels.linear import EPS, linear_attention_step  # the torch step lives beside its kernel
from engine.kernels.linear import why_not as kernel_why_not

CHUNK = 64          # block length of the chunked parallel form
GPU_CHUNK = 512     # the stateless forms' block on a GPU: the same sums in bigger blocks, 8x fewer kernel launches


def stateless_chunk(x: torch.Tensor) -> int:
    """The block length of a whole-sequence (stateless) form for a tensor on x's device: on a GPU the
    chunked loop is kernel-launch bound (a linearize finetune of 8,192-token rows took 8 s a step on an
    H200 with 64), so it takes bigger blocks there; the CPU keeps CHUNK."""
    return GPU_CHUNK if x.is_cuda else CHUNK


@dataclass(eq=False)
class LinearState(State):
    S: torch.Tensor = None           # (L, B, Hkv, F, Dv) fp32 (fp64 for an fp64 model)
    z: torch.Tensor = None           # (L, B, Hkv, F) fp32 (fp64 for an fp64 model)
    feature_map: FeatureMap = None
    layer_ids: tuple[int, ...] | None = None   # model layer of each state layer (hybrid); None: 0..L-1

    path = "linear"

    @classmethod
    def allocate(cls, cfg, batch: int, max_len: int | None, device, dtype,
                 feature_map: str | FeatureMap | None = None, layers=None) -> "LinearState":
        """layers: the model layers this state serves (a hybrid's linear layers); None: all."""
        fmap = as_feature_map(feature_map or cfg.feature_map)
        F_ = fmap.out_dim(cfg.head_dim)
        L = cfg.num_hidden_layers if layers is None else len(layers)
        Hkv, sd = cfg.num_key_value_heads, state_dtype(dtype)
        return cls(lengths=torch.zeros(batch, dtype=torch.long, device=device), slots=0,
                   S=torch.zeros(L, batch, Hkv, F_, cfg.head_dim, device=device, dtype=sd),
                   z=torch.zeros(L, batch, Hkv, F_, device=device, dtype=sd),
                   feature_map=fmap, layer_ids=None if layers is None else tuple(layers))

    max_len = None   # no capacity limit: the state does not grow

    def __post_init__(self):
        self._layers = list(zip(self.S.unbind(0), self.z.unbind(0)))   # per-layer views, made once

    def tensors(self):
        return [self.S, self.z]

    # ------------------------------------------------------------------ saving and batching
    def identity(self) -> dict:
        L, _, Hkv, F_, Dv = self.S.shape
        return {"path": self.path, "layers": L, "kv_heads": Hkv, "features": F_, "head_dim": Dv,
                "feature_map": self.feature_map.name, "dtype": str(self.S.dtype).removeprefix("torch."),
                "layer_ids": None if self.layer_ids is None else list(self.layer_ids)}

    def _saved_tensors(self):
        return {"S": self.S, "z": self.z}

    def _load_tensors(self, tensors, slots):
        self.S.copy_(tensors["S"])
        self.z.copy_(tensors["z"])

    def select_rows(self, idx, max_len=None) -> "LinearState":
        idx = [int(i) for i in idx]
        out = LinearState(lengths=take_rows(self.lengths, idx, 0), slots=0, S=take_rows(self.S, idx, 1),
                          z=take_rows(self.z, idx, 1), feature_map=self.feature_map, layer_ids=self.layer_ids)
        out.slots = int(out.lengths.max()) if len(idx) else 0
        out._after_regroup()
        return out

    @classmethod
    def concat(cls, states, max_len=None) -> "LinearState":
        cls.check_same_identity(states, "shapes, dtypes or feature maps")
        out = cls(lengths=torch.cat([s.lengths for s in states]), slots=0,
                  S=torch.cat([s.S for s in states], 1), z=torch.cat([s.z for s in states], 1),
                  feature_map=states[0].feature_map, layer_ids=states[0].layer_ids)
        out.slots = int(out.lengths.max())
        out._after_regroup()
        return out

    @classmethod
    def from_state_dict(cls, sd, max_len: int | None = None, device=None, feature_map=None) -> "LinearState":
        """A new state from `state_dict()` output (`max_len` is ignored: the state does not grow).
        feature_map: the map object to run (a model's learned maps); default: the fixed map saved by name."""
        S, z = sd["tensors"]["S"], sd["tensors"]["z"]
        ids = sd["meta"].get("layer_ids")
        out = cls(lengths=torch.zeros(S.shape[1], dtype=torch.long, device=device or S.device), slots=0,
                  S=torch.zeros_like(S, device=device), z=torch.zeros_like(z, device=device),
                  feature_map=feature_map or get_feature_map(sd["meta"]["feature_map"]),
                  layer_ids=None if ids is None else tuple(ids))
        out.load_state_dict(sd)
        return out

    def attend(self, layer: int, q, k, v, span):
        """q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, Dv) in q's dtype."""
        S, z = self._layers[layer]                          # (B, Hkv, F, Dv), (B, Hkv, F)
        model_layer = self.model_layer(layer)
        fm = self.feature_map
        if span.length == 1 and span.real is None:   # decode: featurize without the pad mask
            if q.is_cuda and kernel_why_not(q, S, z, v) is None:
                return self._fused_decode(model_layer, q, k, v, S, z)
            B, H, _, _ = q.shape
            phi_k = fm(k, model_layer, "k")                                 # (B, Hkv, 1, F)
            phi_q = fm(q, model_layer, "q").view(B, k.shape[1], H // k.shape[1], 1, phi_k.shape[-1])
            v = v if v.dtype == phi_k.dtype else v.to(phi_k.dtype)
            ld = fm.decay(model_layer, v)                                   # (Hkv, F), gated (B, Hkv, 1, F)
            out = linear_attention_step(phi_q, phi_k, v, S, z,
                                        None if ld is None else (ld if ld.dim() == 2 else ld[:, :, 0]).exp())
            out = out.view(B, H, 1, out.shape[-1])
            return out if out.dtype == q.dtype else out.to(q.dtype)
        phi_q, phi_k, v32 = featurize(fm, q, k, v, span.real, model_layer)
        ld = token_decay(fm.decay(model_layer, v32), span.real)
        if span.length == 1:
            out = linear_attention_step(phi_q, phi_k, v32, S, z, None if ld is None else ld[:, :, 0].exp())
        else:
            out, S_new, z_new = linear_attention_chunked(phi_q, phi_k, v32, S, z, log_decay=ld)
            S.copy_(S_new)
            z.copy_(z_new)
        return out.flatten(1, 2).to(q.dtype)

    def map_in_kernel_why_not(self, layer: int, q, k, v) -> str | None:
        """None when the one-token decode of state layer `layer` on these q (B, H, 1, D), k, v (B, Hkv, 1, D)
        runs as one Triton kernel with the feature map applied inside it (elu1; hedgehog with its decay
        and gate); else why not (the map then runs in torch: before the fused step on CUDA)."""
        S, z = self._layers[layer]
        reason = kernel_why_not(q, S, z, v)
        fm = self.feature_map
        if reason is None and type(fm) is Hedgehog:
            reason = why_not_hedgehog(q, k, v, S, z, hedgehog_layer(fm, self.model_layer(layer)))
        elif reason is None and type(fm) is not Elu1:
            reason = f"the {fm.name} map has no in-kernel form: it runs in torch before the fused step"
        return reason

    def model_layer(self, layer: int) -> int:
        return layer if self.layer_ids is None else self.layer_ids[layer]

    def _fused_decode(self, layer: int, q, k, v, S, z):
        """The decode step as one Triton kernel (engine.kernels; CUDA): the elu+1 map and a hedgehog map
        (with its decay and gate) applied inside it where `why_not_hedgehog` allows, any other map (a
        matmul and a softmax for hedgehog) in torch first. Same arithmetic as the torch step."""
        fm = self.feature_map
        if type(fm) is Hedgehog:
            maps = hedgehog_layer(fm, layer)
            if why_not_hedgehog(q, k, v, S, z, maps) is None:
                return linear_decode_hedgehog(q, k, v, S, z, maps)
        ld = fm.decay(layer, v)                                             # (Hkv, F), gated (B, Hkv, 1, F)
        decay = None if ld is None else (ld if ld.dim() == 2 else ld[:, :, 0]).exp()
        if type(fm) is Elu1:
            return linear_decode_elu1(q, k, v, S, z, decay)
        B, H, _, _ = q.shape
        phi_k = fm(k, layer, "k")                                           # (B, Hkv, 1, F)
        phi_q = fm(q, layer, "q").view(B, k.shape[1], H // k.shape[1], 1, phi_k.shape[-1])
        return linear_decode(phi_q, phi_k, v, S, z, decay, out_dtype=q.dtype).view(B, H, 1, -1)


def hedgehog_layer(fm: Hedgehog, layer: int) -> HedgehogLayer:
    """Model layer `layer`'s hedgehog maps as the decode kernel reads them (raises as the map does when it
    has no such layer)."""
    fm.check_layer(layer)
    dl, gw = fm.decay_logit, fm.gate_weight
    return HedgehogLayer(fm.q_weight[layer], fm.q_bias[layer], fm.k_weight[layer], fm.k_bias[layer],
                         None if dl is None else dl[layer], None if gw is None else gw[layer], GATE_EPS)


def as_feature_map(fmap: str | FeatureMap) -> FeatureMap:
    return get_feature_map(fmap) if isinstance(fmap, str) else fmap


def featurize(fmap, q, k, v, valid=None, layer: int | None = None):
    """Apply phi in fp32 (layer `layer`'s map), group query heads by their kv head, zero pad keys.

    Returns phi_q (B, Hkv, G, T, F), phi_k (B, Hkv, T, F), v (B, Hkv, T, Dv), all fp32.
    """
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    phi_q = fmap(q, layer, "q").view(B, Hkv, H // Hkv, T, -1)
    phi_k = fmap(k, layer, "k")
    if valid is not None:
        phi_k = phi_k * valid[:, None, :, None]
    return phi_q, phi_k, v.to(phi_k.dtype)


def token_decay(ld, valid=None):
    """A map's log decay (Hkv, F), or a gated one (B, Hkv, T, F), or None -> per token (1 or B, Hkv,
    1 or T, F), 0 at pads; None stays None."""
    if ld is None:
        return None
    ld = ld[None, :, None, :] if ld.dim() == 2 else ld
    return ld if valid is None else ld * valid[:, None, :, None]


def linear_attention_chunked(phi_q, phi_k, v, S=None, z=None, chunk: int = CHUNK, log_decay=None):
    """Chunked parallel form: masked quadratic inside a chunk, the carried state across chunks.

    Cost is linear in T and the (T, F, Dv) cumulative sum is never built. Differentiable
    (used for training); returns (out (B, Hkv, G, T, Dv), S_new, z_new) without touching S, z.
    log_decay: None, or per token (1 or B, Hkv, T, F) (`token_decay`); with one the blocks are
    `decayed_parts`' 64-token chunks whatever `chunk`.
    """
    B, Hkv, G, T, F_ = phi_q.shape
    Dv = v.shape[-1]
    if S is None:
        S = phi_q.new_zeros(B, Hkv, F_, Dv)
        z = phi_q.new_zeros(B, Hkv, F_)
    if log_decay is not None:
        num, den, S, z = decayed_parts(phi_q, phi_k, v, S, z, log_decay)
        return num / (den + EPS), S, z
    outs = []
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        num, den, S, z = linear_chunk(phi_q[:, :, :, s:e], phi_k[:, :, s:e], v[:, :, s:e], S, z)
        outs.append(num / (den + EPS))
    return torch.cat(outs, dim=3), S, z


def decayed_parts(phi_q, phi_k, v, S, z, log_decay, chunk: int = CHUNK):
    """Causal linear attention with a decay over a whole block, all chunks at once (the chunked form
    of gated linear attention): numerator (B, Hkv, G, T, Dv) and denominator (B, Hkv, G, T, 1) of every
    query, and the state after the block. log_decay (1|B, Hkv, 1|T, F).

    Inside each chunk of `chunk` tokens the weights are `linear_chunk`'s (split around the chunk's
    middle, no factor above e^{|log decay| chunk / 2}), computed for every chunk in one batch; across
    chunks each chunk's own state (its keys decayed to its end) is carried by a scan of two updates a
    chunk, so a block costs a few batched kernels plus that scan whatever its length (a loop over
    64-token chunks was kernel-launch bound on a GPU)."""
    B, Hkv, G, T, F_ = phi_q.shape
    Dv = v.shape[-1]
    C = min(chunk, T)   # (a one-token step: one chunk of one)
    N = -(-T // C)
    pad = N * C - T
    ld = log_decay.expand(-1, -1, T, -1)
    if pad:   # zero keys add nothing, zero log decay decays nothing; the padded queries are cut off
        phi_q, phi_k, v, ld = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v, ld))
    q = phi_q.reshape(B, Hkv, G, N, C, F_)
    k = phi_k.reshape(phi_k.shape[0], Hkv, N, C, F_)
    vv = v.reshape(v.shape[0], Hkv, N, C, Dv)
    c = ld.reshape(ld.shape[0], Hkv, N, C, F_).cumsum(3)                    # inclusive, from each chunk's start
    mid, last = c[:, :, :, C // 2:C // 2 + 1], c[:, :, :, -1:]
    A = ((q * (c - mid).exp().unsqueeze(2)) @ (k * (mid - c).exp()).unsqueeze(2).transpose(-1, -2)).tril()
    qd = q * c.exp().unsqueeze(2)                                           # reads the state before the chunk
    kl = k * (last - c).exp()                                               # decayed to the chunk's end
    dS, dz = kl.transpose(-1, -2) @ vv, kl.sum(3)                           # (B, Hkv, N, F, Dv), (B, Hkv, N, F)
    carry = last[:, :, :, 0].exp()                                          # (1|B, Hkv, N, F)
    before_S, before_z = [], []
    for n in range(N):
        before_S.append(S)
        before_z.append(z)
        S = carry[:, :, n, :, None] * S + dS[:, :, n]
        z = carry[:, :, n] * z + dz[:, :, n]
    Sb, zb = torch.stack(before_S, 2), torch.stack(before_z, 2)             # (B, Hkv, N, F, Dv), (B, Hkv, N, F)
    num = qd @ Sb.unsqueeze(2) + A @ vv.unsqueeze(2)                        # (B, Hkv, G, N, C, Dv)
    den = qd @ zb[:, :, None, :, :, None] + A.sum(-1, keepdim=True)
    return (num.reshape(B, Hkv, G, N * C, Dv)[:, :, :, :T], den.reshape(B, Hkv, G, N * C, 1)[:, :, :, :T], S, z)


def linear_chunk(qc, kc, vc, S, z):
    """One chunk of causal linear attention after the state (S, z) of the keys before it: the
    numerator (B, Hkv, G, C, Dv) and denominator (B, Hkv, G, C, 1) of its queries (query t reads keys
    up to its own), and the state after its keys. qc (B, Hkv, G, C, F); kc (B, Hkv, C, F); vc (B, Hkv,
    C, Dv). (With a decay: `decayed_parts`.)"""
    A = (qc @ kc.unsqueeze(2).transpose(-1, -2)).tril()          # (B, Hkv, G, C, C)
    num = qc @ S.unsqueeze(2) + A @ vc.unsqueeze(2)               # (B, Hkv, G, C, Dv)
    den = qc @ z[:, :, None, :, None] + A.sum(-1, keepdim=True)   # (B, Hkv, G, C, 1)
    return num, den, S + kc.transpose(-1, -2) @ vc, z + kc.sum(2)


def fp32_under_autocast(fn):
    """Run a stateless attention form in fp32 when called under autocast (`gen linearize
    --finetune-dtype bfloat16`): the feature maps, the running sums and the normaliser's division
    stay fp32 (with them in bf16 the finetune's loss blew up after ~350 steps); the projections
    around it keep autocast's dtype. Outside autocast: fn itself, untouched."""
    @functools.wraps(fn)
    def wrapper(q, k, v, *args, **kwargs):
        if not torch.is_autocast_enabled(q.device.type):
            return fn(q, k, v, *args, **kwargs)
        with torch.autocast(q.device.type, enabled=False):
            return fn(q.float(), k.float(), v.float(), *args, **kwargs).to(q.dtype)
    return wrapper


@fp32_under_autocast
def linear_attention(q, k, v, feature_map: str | FeatureMap, valid=None, layer: int | None = None):
    """Stateless causal linear attention over a whole sequence (training and full forward)."""
    fmap = as_feature_map(feature_map)
    phi_q, phi_k, v32 = featurize(fmap, q, k, v, valid, layer)
    ld = token_decay(fmap.decay(layer, v32), valid)
    out, _, _ = linear_attention_chunked(phi_q, phi_k, v32, chunk=stateless_chunk(q), log_decay=ld)
    return out.flatten(1, 2).to(q.dtype)


def linear_attention_reference(q, k, v, feature_map: str | FeatureMap, valid=None, layer: int | None = None):
    """Plain-torch twin: the naive masked quadratic form, plus the final S and z it implies.

    Returns out (B, H, T, Dv), S (B, Hkv, F, Dv), z (B, Hkv, F).
    """
    fmap = as_feature_map(feature_map)
    B, H, T, _ = q.shape
    groups = H // k.shape[1]
    phi_q = fmap(q, layer, "q")
    phi_k = fmap(k, layer, "k")
    if valid is not None:
        phi_k = phi_k * valid[:, None, :, None]
    v = v.to(phi_k.dtype)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    ld = token_decay(fmap.decay(layer, v), valid)
    if ld is None:
        A = (phi_q @ phi_k.repeat_interleave(groups, 1).transpose(-1, -2)) * causal    # (B, H, T, T)
        S = torch.einsum("bhtf,bhtd->bhfd", phi_k, v)
        z = phi_k.sum(2)
    else:   # weight e^{c_t - c_j} of key j at query t, c the cumulative log decay (T x T x F)
        c = ld.expand(B, -1, T, -1).cumsum(2)                                          # (B, Hkv, T, F)
        w = (c[:, :, :, None, :] - c[:, :, None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
        A = torch.einsum("bhtf,bhjf,bhtjf->bhtj", phi_q, phi_k.repeat_interleave(groups, 1),
                         w.repeat_interleave(groups, 1))
        kd = phi_k * (c[:, :, -1:] - c).exp()
        S = torch.einsum("bhtf,bhtd->bhfd", kd, v)
        z = kd.sum(2)
    out = (A @ v.repeat_interleave(groups, 1)) / (A.sum(-1, keepdim=True) + EPS)
    return out.to(q.dtype), S, z
