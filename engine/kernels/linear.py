"""The linear-attention decode step: the torch form and the fused Triton kernel behind one signature.

    S = diag(decay) S + phi(k) v^T,  z = decay * z + phi(k),  out = phi(q)^T S / (phi(q)^T z + EPS)

`linear_attention_step` is the plain-torch form (the module reference every step form is held to;
re-exported by engine.attention.linear). `linear_decode` runs the same step as one Triton kernel per
call where `why_not()` allows (CUDA, or CPU under TRITON_INTERPRET=1) and the torch form elsewhere;
`linear_decode_elu1` also applies the elu+1 map inside the kernel, from the raw q and k;
`linear_decode_hedgehog` the learned hedgehog map (xW + b and its two softmaxes, for q and k) and its
decay, constant or gated, from the raw q, k, v and the layer's map tensors (`HedgehogLayer`). It has no
torch form of its own: its caller (LinearState) featurizes in torch where `why_not_hedgehog` says why.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kernels import backend

EPS = 1e-6          # the denominator's eps: out = num / (phi(q)^T z + EPS)
# 0-dim tensors in each state dtype: no scalar wrap and no dtype cast per decode step
_EPS = {dt: torch.tensor(EPS, dtype=dt) for dt in (torch.float32, torch.float64)}
MAX_DV = 256        # one program holds a head's whole Dv (see linear_triton)
# The hedgehog kernel's block: its (G, D, columns) tile of the map's weights holds <= HEDGEHOG_TILE
# products, in HEDGEHOG_WARPS warps. Chosen from ptxas's report for sm_90 (no GPU at hand): no spills for
# D 64-256 and G 1-8 (4096 and 8192 spilled at G <= 2, D 64); benchmarks/gpu_kernels.py times others.
HEDGEHOG_TILE = 2048
HEDGEHOG_WARPS = 8


def linear_attention_step(phi_q, phi_k, v, S, z, decay=None):
    """One token of the recurrence; updates S (B, Hkv, F, Dv) and z (B, Hkv, F) in place.

    phi_q (B, Hkv, G, 1, F), phi_k (B, Hkv, 1, F), v (B, Hkv, 1, Dv) -> (B, Hkv, G, 1, Dv).
    decay: None, or the factors exp(log decay) (Hkv, F) or (B, Hkv, F) that S and z take first.
    """
    if decay is not None:
        S.mul_(decay.unsqueeze(-1))
        z.mul_(decay)
    S.addcmul_(phi_k.transpose(-1, -2), v)                          # (B, Hkv, F, 1) * (B, Hkv, 1, Dv)
    z.add_(phi_k[:, :, 0])
    num = phi_q @ S.unsqueeze(2)                                    # (B, Hkv, G, 1, Dv)
    den = phi_q @ z[:, :, None, :, None]                            # (B, Hkv, G, 1, 1)
    return num / (den + _EPS[den.dtype])


def elu1(x):
    """elu(x) + 1 as exp(clamp(x, -60, 0)) + relu(x): the arithmetic of the Elu1 map (engine.attention.
    feature_maps, which keeps its own copy off this call on the CPU's hot path; a test holds them equal)."""
    return torch.exp(x.clamp(-60.0, 0.0)) + torch.relu(x)


def why_not(phi_q, S, z, v) -> str | None:
    """None when `linear_decode` runs the kernel on these tensors; else why it runs the torch form."""
    reason = backend.why_not(phi_q, S, z, v)
    if reason is None and (S.dtype != torch.float32 or z.dtype != torch.float32):
        reason = f"a {str(S.dtype).removeprefix('torch.')} state: the kernel updates a float32 one"
    if reason is None and S.shape[-1] > MAX_DV:
        reason = f"head dim {S.shape[-1]} > {MAX_DV}: one program holds a head's Dv"
    return reason


class HedgehogLayer(NamedTuple):
    """One layer's hedgehog maps (engine.attention.feature_maps.Hedgehog) as the kernel reads them: any
    dtype the kernels read (widened to float32 inside), any strides."""
    q_weight: torch.Tensor                  # (H, D, D): y = x W + b per query head
    q_bias: torch.Tensor                    # (H, D)
    k_weight: torch.Tensor                  # (Hkv, D, D)
    k_bias: torch.Tensor                    # (Hkv, D)
    decay_logit: torch.Tensor | None        # (Hkv, 2D): log decay = -sigmoid(decay_logit), or None
    gate_weight: torch.Tensor | None        # (Hkv, D, 2D): + rms(v) gate_weight in the logit, or None
    gate_eps: float                         # rms(v) = v / sqrt(mean(v^2) + gate_eps)


def why_not_hedgehog(q, k, v, S, z, maps: HedgehogLayer) -> str | None:
    """None when `linear_decode_hedgehog` runs on these tensors; else why the map runs in torch."""
    reason = why_not(q, S, z, v)
    if reason is not None:
        return reason
    tensors = [t for t in maps[:6] if t is not None]
    for t in tensors:
        if t.device != q.device:
            return f"the hedgehog maps are on {t.device}, the queries on {q.device}"
        if t.dtype not in backend.SUPPORTED:
            return f"{str(t.dtype).removeprefix('torch.')} hedgehog maps: the kernel reads float32, float16 and bfloat16"
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    want = {"q_weight": (H, D, D), "q_bias": (H, D), "k_weight": (Hkv, D, D), "k_bias": (Hkv, D),
            "decay_logit": (Hkv, 2 * D), "gate_weight": (Hkv, D, 2 * D)}
    for name, shape in want.items():
        t = getattr(maps, name)
        if t is not None and tuple(t.shape) != shape:
            return f"hedgehog {name} {tuple(t.shape)}, not {shape} for {H}/{Hkv} heads of {D}"
    if maps.gate_weight is not None and maps.decay_logit is None:
        return "a gate without a decay"
    if tuple(S.shape[-2:]) != (2 * D, D) or v.shape[-1] != D:
        return f"a state of {tuple(S.shape[-2:])} for heads of {D}: the hedgehog map has 2D features"
    return None


def linear_decode(phi_q, phi_k, v, S, z, decay=None, out_dtype=None):
    """`linear_attention_step` as one fused kernel: same arguments, same in-place update of S and z.

    phi_q (B, Hkv, G, 1, F), phi_k (B, Hkv, 1, F), v (B, Hkv, 1, Dv); S (B, Hkv, F, Dv) and
    z (B, Hkv, F) float32; decay None, (Hkv, F) or (B, Hkv, F) -> (B, Hkv, G, 1, Dv) in out_dtype
    (default phi_q's dtype). The torch form runs where `why_not` gives a reason.
    """
    if why_not(phi_q, S, z, v) is not None:
        out = linear_attention_step(phi_q, phi_k, v, S, z, decay)
        return out if out_dtype is None else out.to(out_dtype)
    B, Hkv, G, _, F_ = phi_q.shape
    out = torch.empty(B, Hkv, G, 1, S.shape[-1], device=S.device, dtype=out_dtype or phi_q.dtype)
    _launch(phi_q[:, :, :, 0], phi_k[:, :, 0], v[:, :, 0], S, z, decay, out[:, :, :, 0], elu=False)
    return out


def linear_decode_elu1(q, k, v, S, z, decay=None):
    """The decode step of the elu+1 map from the raw q (B, H, 1, D) and k (B, Hkv, 1, D), the map
    applied inside the kernel (in float32, as the Elu1 map does); v (B, Hkv, 1, Dv) -> (B, H, 1, Dv)
    in q's dtype. S, z, decay as `linear_decode`."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    if why_not(q, S, z, v) is not None:
        phi_q = elu1(q.to(S.dtype)).view(B, Hkv, H // Hkv, 1, D)
        phi_k = elu1(k.to(S.dtype))
        out = linear_attention_step(phi_q, phi_k, v.to(phi_k.dtype), S, z, decay)
        return out.view(B, H, 1, -1).to(q.dtype)
    out = torch.empty(B, H, 1, S.shape[-1], device=S.device, dtype=q.dtype)
    _launch(q[:, :, 0].unflatten(1, (Hkv, H // Hkv)), k[:, :, 0], v[:, :, 0], S, z, decay,
            out[:, :, 0].unflatten(1, (Hkv, H // Hkv)), elu=True)
    return out


def linear_decode_hedgehog(q, k, v, S, z, maps: HedgehogLayer):
    """The decode step of a hedgehog map from the raw q (B, H, 1, D), k and v (B, Hkv, 1, D), after
    rotary: phi(x) = [softmax(xW + b), softmax(-(xW + b))] of each head applied inside the kernel, in
    float32, and with a decay (`maps.decay_logit`, gated by v with `maps.gate_weight`) S and z decayed
    first, as the Hedgehog map's `decay` gives it. S (B, Hkv, 2D, D), z (B, Hkv, 2D) float32, updated
    in place -> (B, H, 1, D) in q's dtype. Only where `why_not_hedgehog` is None."""
    import triton
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    out = torch.empty(B, H, 1, D, device=S.device, dtype=q.dtype)
    qv, ov = q[:, :, 0].unflatten(1, (Hkv, G)), out[:, :, 0].unflatten(1, (Hkv, G))
    kv, vv = k[:, :, 0], v[:, :, 0]
    qw, qb = maps.q_weight.unflatten(0, (Hkv, G)), maps.q_bias.unflatten(0, (Hkv, G))
    dl, gw = maps.decay_logit, maps.gate_weight
    GB = max(2, triton.next_power_of_2(G))                             # (no block of one row)
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_F = max(1, min(BLOCK_D, HEDGEHOG_TILE // (GB * BLOCK_D)))     # columns a block (see HEDGEHOG_TILE)
    backend.kernel("linear_triton", "hedgehog_decode_kernel")[(B * Hkv,)](
        qv, kv, vv, S, z, ov, qw, qb, maps.k_weight, maps.k_bias,
        dl if dl is not None else S, gw if gw is not None else S, EPS, maps.gate_eps,
        Hkv, G, *qv.stride(), *kv.stride(), *vv.stride(), *S.stride(), *z.stride(),
        *qw.stride(), *qb.stride(), *maps.k_weight.stride(), *maps.k_bias.stride(),
        *(dl.stride() if dl is not None else (0, 0)), *(gw.stride() if gw is not None else (0, 0, 0)),
        *ov.stride(),
        D=D, HAS_DECAY=dl is not None, HAS_GATE=gw is not None, GB=GB, BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D,
        num_warps=HEDGEHOG_WARPS)
    return out


def _launch(q, k, v, S, z, decay, out, elu: bool):
    """q (B, Hkv, G, F), k (B, Hkv, F), v (B, Hkv, Dv), S, z, decay, out (B, Hkv, G, Dv): any strides."""
    import triton
    B, Hkv, G, F_ = q.shape
    Dv = S.shape[-1]
    if decay is not None:
        decay = decay if decay.dim() == 3 else decay.unsqueeze(0)          # (1 or B, Hkv, F)
        sd = (decay.stride(0) if decay.shape[0] > 1 else 0, decay.stride(1), decay.stride(2))
    else:
        sd = (0, 0, 0)
    GB = max(2, triton.next_power_of_2(G))                             # (no block of one row)
    BLOCK_DV = triton.next_power_of_2(Dv)
    BLOCK_F = max(1, min(triton.next_power_of_2(F_), 8192 // (GB * BLOCK_DV)))   # <= 8k products a block
    backend.kernel("linear_triton", "linear_decode_kernel")[(B * Hkv,)](
        q, k, v, S, z, decay if decay is not None else S, out, EPS,
        Hkv, G, Dv, *q.stride(), *k.stride(), *v.stride(), *S.stride(), *z.stride(), *sd, *out.stride(),
        F=F_, ELU1=elu, HAS_DECAY=decay is not None, GB=GB, BLOCK_F=BLOCK_F, BLOCK_DV=BLOCK_DV)
