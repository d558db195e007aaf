"""The fused linear-attention decode step in Triton (imported only once triton imports).

One program per (row b, kv head h) owns the whole (F, Dv) state of that head: it loops over F in
blocks, and for each block decays S and z, adds phi(k) v^T and phi(k), writes them back and
accumulates the readout of the G query heads that share the head, num (G, Dv) and den (G), from
the same registers: S is read once and written once. Dv is not split across programs because z
is updated in place and every Dv tile would need it before and after its update.
"""
import triton.language as tl

from engine.kernels.backend import jit


@jit
def linear_decode_kernel(
        q_ptr, k_ptr, v_ptr, S_ptr, z_ptr, d_ptr, out_ptr, eps,
        Hkv, G, Dv,
        sq_b, sq_h, sq_g, sq_f,        # phi_q (or q) as (B, Hkv, G, F)
        sk_b, sk_h, sk_f,              # phi_k (or k) (B, Hkv, F)
        sv_b, sv_h, sv_d,              # v (B, Hkv, Dv)
        sS_b, sS_h, sS_f, sS_d,        # S (B, Hkv, F, Dv), updated in place
        sz_b, sz_h, sz_f,              # z (B, Hkv, F), updated in place
        sd_b, sd_h, sd_f,              # decay factors (B or 1, Hkv, F); sd_b = 0 when shared by the rows
        so_b, so_h, so_g, so_d,        # out as (B, Hkv, G, Dv)
        F: tl.constexpr, ELU1: tl.constexpr, HAS_DECAY: tl.constexpr,
        GB: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)
    h = (pid % Hkv).to(tl.int64)
    gs = tl.arange(0, GB)
    ds = tl.arange(0, BLOCK_DV)
    g_ok = gs < G
    d_ok = ds < Dv
    v = tl.load(v_ptr + b * sv_b + h * sv_h + ds * sv_d, mask=d_ok, other=0.0).to(tl.float32)
    num = tl.zeros((GB, BLOCK_DV), dtype=tl.float32)
    den = tl.zeros((GB,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):   # F a constexpr: Triton 3.6's interpreter cannot loop to a
        # runtime bound under numpy >= 2.4 (triton-lang/triton#9171)
        fs = f0 + tl.arange(0, BLOCK_F)
        f_ok = fs < F
        qf_ok = g_ok[:, None] & f_ok[None, :]
        sf_ok = f_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b * sk_b + h * sk_h + fs * sk_f, mask=f_ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + gs[:, None] * sq_g + fs[None, :] * sq_f,
                    mask=qf_ok, other=0.0).to(tl.float32)
        if ELU1:   # elu(x) + 1 as the Elu1 map writes it: exp(clamp(x, -60, 0)) + relu(x); 0 off the edges
            k = tl.where(f_ok, tl.exp(tl.minimum(tl.maximum(k, -60.0), 0.0)) + tl.maximum(k, 0.0), 0.0)
            q = tl.where(qf_ok, tl.exp(tl.minimum(tl.maximum(q, -60.0), 0.0)) + tl.maximum(q, 0.0), 0.0)
        s_at = S_ptr + b * sS_b + h * sS_h + fs[:, None] * sS_f + ds[None, :] * sS_d
        z_at = z_ptr + b * sz_b + h * sz_h + fs * sz_f
        S = tl.load(s_at, mask=sf_ok, other=0.0)
        z = tl.load(z_at, mask=f_ok, other=0.0)
        if HAS_DECAY:
            d = tl.load(d_ptr + b * sd_b + h * sd_h + fs * sd_f, mask=f_ok, other=0.0).to(tl.float32)
            S = S * d[:, None]
            z = z * d
        S = S + k[:, None] * v[None, :]
        z = z + k
        tl.store(s_at, S, mask=sf_ok)
        tl.store(z_at, z, mask=f_ok)
        num += tl.sum(q[:, :, None] * S[None, :, :], axis=1)
        den += tl.sum(q * z[None, :], axis=1)
    out = num / (den[:, None] + eps)
    o_at = out_ptr + b * so_b + h * so_h + gs[:, None] * so_g + ds[None, :] * so_d
    tl.store(o_at, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
