"""The linear-attention decode step: the torch form and the fused Triton kernel behind one signature.

    S = diag(decay) S + phi(k) v^T,  z = decay * z + phi(k),  out = phi(q)^T S / (phi(q)^T z + EPS)

`linear_attention_step` is the plain-torch form (the module reference every step form is held to;
re-exported by engine.attention.linear). `linear_decode` runs the same step as one Triton kernel per
call where `why_not()` allows (CUDA, or CPU under TRITON_INTERPRET=1) and the torch form elsewhere;
`linear_decode_elu1` also applies the elu+1 map inside the kernel, from the raw q and k.
"""
from __future__ import annotations

import torch

from engine.kernels import backend

EPS = 1e-6          # the denominator's eps: out = num / (phi(q)^T z + EPS)
# 0-dim tensors in each state dtype: no scalar wrap and no dtype cast per decode step
_EPS = {dt: torch.tensor(EPS, dtype=dt) for dt in (torch.float32, torch.float64)}
MAX_DV = 256        # one program holds a head's whole Dv (see linear_triton)


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
