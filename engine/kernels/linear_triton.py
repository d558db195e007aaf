"""The fused linear-attention decode step in Triton (imported only once triton imports).

One program per (row b, kv head h) owns the whole (F, Dv) state of that head: it loops over F in
blocks, and for each block decays S and z, adds phi(k) v^T and phi(k), writes them back and
accumulates the readout of the G query heads that share the head, num (G, Dv) and den (G), from
the same registers: S is read once and written once. Dv is not split across programs because z
is updated in place and every Dv tile would need it before and after its update.

`linear_decode_kernel` takes phi(q) and phi(k) (or applies elu+1 to q and k itself);
`hedgehog_decode_kernel` computes the learned hedgehog map of q and k, and its decay (constant or
gated by the token's value), inside the program from the raw q, k, v and the layer's map tensors.
"""
import triton.language as tl

from engine.kernels.backend import jit


@jit
def state_block(S_ptr, z_ptr, b, h, fs, ds, f_ok, d_ok, sS_b, sS_h, sS_f, sS_d, sz_b, sz_h, sz_f,
                q, k, v, d, HAS_DECAY: tl.constexpr):
    """Features fs of head (b, h): S, z = d * (S, z) (HAS_DECAY) + (k v^T, k), written back; returns this
    block's share of the readout from q (GB, BLOCK_F): num (GB, BLOCK_DV) and den (GB,)."""
    sf_ok = f_ok[:, None] & d_ok[None, :]
    s_at = S_ptr + b * sS_b + h * sS_h + fs[:, None] * sS_f + ds[None, :] * sS_d
    z_at = z_ptr + b * sz_b + h * sz_h + fs * sz_f
    S = tl.load(s_at, mask=sf_ok, other=0.0)
    z = tl.load(z_at, mask=f_ok, other=0.0)
    if HAS_DECAY:
        S = S * d[:, None]
        z = z * d
    S = S + k[:, None] * v[None, :]
    z = z + k
    tl.store(s_at, S, mask=sf_ok)
    tl.store(z_at, z, mask=f_ok)
    return tl.sum(q[:, :, None] * S[None, :, :], axis=1), tl.sum(q * z[None, :], axis=1)


@jit
def store_readout(out_ptr, b, h, gs, ds, g_ok, d_ok, so_b, so_h, so_g, so_d, num, den, eps):
    """out[b, h, g, :] = num / (den + eps) for the group's query heads g, in the output's dtype."""
    out = num / (den[:, None] + eps)
    o_at = out_ptr + b * so_b + h * so_h + gs[:, None] * so_g + ds[None, :] * so_d
    tl.store(o_at, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


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
        k = tl.load(k_ptr + b * sk_b + h * sk_h + fs * sk_f, mask=f_ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + gs[:, None] * sq_g + fs[None, :] * sq_f,
                    mask=qf_ok, other=0.0).to(tl.float32)
        if ELU1:   # elu(x) + 1 as the Elu1 map writes it: exp(clamp(x, -60, 0)) + relu(x); 0 off the edges
            k = tl.where(f_ok, tl.exp(tl.minimum(tl.maximum(k, -60.0), 0.0)) + tl.maximum(k, 0.0), 0.0)
            q = tl.where(qf_ok, tl.exp(tl.minimum(tl.maximum(q, -60.0), 0.0)) + tl.maximum(q, 0.0), 0.0)
        d = k
        if HAS_DECAY:
            d = tl.load(d_ptr + b * sd_b + h * sd_h + fs * sd_f, mask=f_ok, other=0.0).to(tl.float32)
        n, m = state_block(S_ptr, z_ptr, b, h, fs, ds, f_ok, d_ok, sS_b, sS_h, sS_f, sS_d, sz_b, sz_h, sz_f,
                           q, k, v, d, HAS_DECAY)
        num += n
        den += m
    store_readout(out_ptr, b, h, gs, ds, g_ok, d_ok, so_b, so_h, so_g, so_d, num, den, eps)


@jit
def hedgehog_y(xq, xk, qw_ptr, qb_ptr, kw_ptr, kb_ptr, h, gs, ds, es, g_ok, d_ok, e_ok,
               sqw_h, sqw_g, sqw_i, sqw_o, sqb_h, sqb_g, sqb_o, skw_h, skw_i, skw_o, skb_h, skb_o):
    """y = x W + b at output columns es, for the G query heads of kv head h (xq (GB, BLOCK_D) ->
    (GB, BLOCK_E)) and for its key (xk (BLOCK_D,) -> (BLOCK_E,)), in float32; 0 off the edges."""
    qw_ok = (g_ok[:, None, None] & d_ok[None, :, None]) & e_ok[None, None, :]
    wq = tl.load(qw_ptr + h * sqw_h + gs[:, None, None] * sqw_g + ds[None, :, None] * sqw_i
                 + es[None, None, :] * sqw_o, mask=qw_ok, other=0.0).to(tl.float32)
    bq = tl.load(qb_ptr + h * sqb_h + gs[:, None] * sqb_g + es[None, :] * sqb_o,
                 mask=g_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    wk = tl.load(kw_ptr + h * skw_h + ds[:, None] * skw_i + es[None, :] * skw_o,
                 mask=d_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    bk = tl.load(kb_ptr + h * skb_h + es * skb_o, mask=e_ok, other=0.0).to(tl.float32)
    return tl.sum(xq[:, :, None] * wq, axis=1) + bq, tl.sum(xk[:, None] * wk, axis=0) + bk


@jit
def online_softmax_stats(m, s, y, ok):
    """Per lane running max m and sum s of exp(y - m) over the columns seen so far (ok: real ones)."""
    m_new = tl.maximum(m, tl.where(ok, y, -1e30))
    return m_new, s * tl.exp(m - m_new) + tl.where(ok, tl.exp(tl.where(ok, y, m_new) - m_new), 0.0)


@jit
def hedgehog_decode_kernel(
        q_ptr, k_ptr, v_ptr, S_ptr, z_ptr, out_ptr,
        qw_ptr, qb_ptr, kw_ptr, kb_ptr, dl_ptr, gw_ptr, eps, gate_eps,
        Hkv, G,
        sq_b, sq_h, sq_g, sq_d,        # q (B, Hkv, G, D), after rotary
        sk_b, sk_h, sk_d,              # k (B, Hkv, D)
        sv_b, sv_h, sv_d,              # v (B, Hkv, D)
        sS_b, sS_h, sS_f, sS_d,        # S (B, Hkv, 2D, D), updated in place
        sz_b, sz_h, sz_f,              # z (B, Hkv, 2D), updated in place
        sqw_h, sqw_g, sqw_i, sqw_o,    # the layer's q_weight as (Hkv, G, D, D)
        sqb_h, sqb_g, sqb_o,           # q_bias (Hkv, G, D)
        skw_h, skw_i, skw_o,           # k_weight (Hkv, D, D)
        skb_h, skb_o,                  # k_bias (Hkv, D)
        sdl_h, sdl_f,                  # decay_logit (Hkv, 2D)
        sgw_h, sgw_i, sgw_f,           # gate_weight (Hkv, D, 2D)
        so_b, so_h, so_g, so_d,        # out (B, Hkv, G, D)
        D: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_GATE: tl.constexpr,
        GB: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    """The decode step of a hedgehog map, phi(x) = [softmax(y), softmax(-y)], y = x W + b (F = 2D),
    with its decay exp(-sigmoid(decay_logit [+ rms(v) gate_weight])) when it has one.

    Pass 1 runs over y's D columns in blocks of BLOCK_F and keeps the softmaxes' running max and sum
    (of y and of -y; q's G heads and k). Pass 2 runs over the same column blocks again: it recomputes
    those columns of y (the map's weights are read twice, the second time from cache, rather than a
    scratch round trip and a barrier) and updates the state as linear_decode_kernel does for both
    features of each column: e (softmax(y)) and D + e (softmax(-y))."""
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)
    h = (pid % Hkv).to(tl.int64)
    gs = tl.arange(0, GB)
    ds = tl.arange(0, BLOCK_D)
    g_ok = gs < G
    d_ok = ds < D
    xq = tl.load(q_ptr + b * sq_b + h * sq_h + gs[:, None] * sq_g + ds[None, :] * sq_d,
                 mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    xk = tl.load(k_ptr + b * sk_b + h * sk_h + ds * sk_d, mask=d_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + ds * sv_d, mask=d_ok, other=0.0).to(tl.float32)
    u = v
    if HAS_GATE:   # rms(v) = v / sqrt(mean(v^2) + gate_eps), the gate's input
        u = v / tl.sqrt(tl.sum(v * v, axis=0) / D + gate_eps)
    # pass 1: the softmax statistics, per lane, then reduced
    mq_p = tl.full((GB, BLOCK_F), -1e30, tl.float32)
    mq_n = tl.full((GB, BLOCK_F), -1e30, tl.float32)
    sq_p = tl.zeros((GB, BLOCK_F), dtype=tl.float32)
    sq_n = tl.zeros((GB, BLOCK_F), dtype=tl.float32)
    mk_p = tl.full((BLOCK_F,), -1e30, tl.float32)
    mk_n = tl.full((BLOCK_F,), -1e30, tl.float32)
    sk_p = tl.zeros((BLOCK_F,), dtype=tl.float32)
    sk_n = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for e0 in range(0, D, BLOCK_F):
        es = e0 + tl.arange(0, BLOCK_F)
        e_ok = es < D
        yq, yk = hedgehog_y(xq, xk, qw_ptr, qb_ptr, kw_ptr, kb_ptr, h, gs, ds, es, g_ok, d_ok, e_ok,
                            sqw_h, sqw_g, sqw_i, sqw_o, sqb_h, sqb_g, sqb_o, skw_h, skw_i, skw_o, skb_h, skb_o)
        qe_ok = g_ok[:, None] & e_ok[None, :]
        mq_p, sq_p = online_softmax_stats(mq_p, sq_p, yq, qe_ok)
        mq_n, sq_n = online_softmax_stats(mq_n, sq_n, -yq, qe_ok)
        mk_p, sk_p = online_softmax_stats(mk_p, sk_p, yk, e_ok)
        mk_n, sk_n = online_softmax_stats(mk_n, sk_n, -yk, e_ok)
    Mq_p = tl.max(mq_p, axis=1)
    Mq_n = tl.max(mq_n, axis=1)
    Tq_p = tl.sum(sq_p * tl.exp(mq_p - Mq_p[:, None]), axis=1)
    Tq_n = tl.sum(sq_n * tl.exp(mq_n - Mq_n[:, None]), axis=1)
    Mq_p, Mq_n = tl.where(g_ok, Mq_p, 0.0), tl.where(g_ok, Mq_n, 0.0)   # the rows past G: finite, masked below
    Tq_p, Tq_n = tl.where(g_ok, Tq_p, 1.0), tl.where(g_ok, Tq_n, 1.0)
    Mk_p = tl.max(mk_p, axis=0)
    Mk_n = tl.max(mk_n, axis=0)
    Tk_p = tl.sum(sk_p * tl.exp(mk_p - Mk_p), axis=0)
    Tk_n = tl.sum(sk_n * tl.exp(mk_n - Mk_n), axis=0)
    # pass 2: per block of columns, y once, and the state update and readout of both its features
    num = tl.zeros((GB, BLOCK_D), dtype=tl.float32)
    den = tl.zeros((GB,), dtype=tl.float32)
    for e0 in range(0, D, BLOCK_F):
        es = e0 + tl.arange(0, BLOCK_F)
        e_ok = es < D
        qe_ok = g_ok[:, None] & e_ok[None, :]
        yq, yk = hedgehog_y(xq, xk, qw_ptr, qb_ptr, kw_ptr, kb_ptr, h, gs, ds, es, g_ok, d_ok, e_ok,
                            sqw_h, sqw_g, sqw_i, sqw_o, sqb_h, sqb_g, sqb_o, skw_h, skw_i, skw_o, skb_h, skb_o)
        for half in tl.static_range(2):   # features es: softmax(y); features D + es: softmax(-y)
            if half == 0:
                q = tl.where(qe_ok, tl.exp(yq - Mq_p[:, None]) / Tq_p[:, None], 0.0)
                k = tl.where(e_ok, tl.exp(yk - Mk_p) / Tk_p, 0.0)
            else:
                q = tl.where(qe_ok, tl.exp(-yq - Mq_n[:, None]) / Tq_n[:, None], 0.0)
                k = tl.where(e_ok, tl.exp(-yk - Mk_n) / Tk_n, 0.0)
            fs = es + half * D
            d = k
            if HAS_DECAY:   # exp(log decay), log decay = -sigmoid(logit)
                logit = tl.load(dl_ptr + h * sdl_h + fs * sdl_f, mask=e_ok, other=0.0).to(tl.float32)
                if HAS_GATE:
                    gw = tl.load(gw_ptr + h * sgw_h + ds[:, None] * sgw_i + fs[None, :] * sgw_f,
                                 mask=d_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
                    logit += tl.sum(u[:, None] * gw, axis=0)
                d = tl.exp(-tl.sigmoid(logit))
            n, m = state_block(S_ptr, z_ptr, b, h, fs, ds, e_ok, d_ok, sS_b, sS_h, sS_f, sS_d, sz_b, sz_h, sz_f,
                               q, k, v, d, HAS_DECAY)
            num += n
            den += m
    store_readout(out_ptr, b, h, gs, ds, g_ok, d_ok, so_b, so_h, so_g, so_d, num, den, eps)
