"""Flash decoding (split-K) over a preallocated KV cache in Triton (imported only once triton imports).

`softmax_split_kernel`: grid (B * Hkv, splits); a program takes one (row, kv head) and one range
of keys, stops at the row's length (read from a device tensor: nothing on the host), loads each K/V
tile once for the G query heads of its kv head and keeps an online softmax in fp32: it writes the
partial (max, sum, unnormalised output). `softmax_combine_kernel`: grid (B * H); merges a query
head's partials. A split with no keys writes max -inf and sum 0 and no output (the combine never
reads it); a row with no key at all gets 0.
"""
import triton.language as tl

from engine.kernels.backend import jit


@jit
def _tile(q, k_at, v_at, r_at, start, hi, sc, m, l, acc, d_ok, sk_n, sv_n, sr_n,
          HAS_REAL: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of BLOCK_N keys from `start` (those from `hi` on masked) into the online softmax of the
    GB query rows q: the running max m, sum l and unnormalised output acc, returned updated."""
    ns = start + tl.arange(0, BLOCK_N)
    in_range = ns < hi
    ok = in_range
    if HAS_REAL:
        ok = ok & (tl.load(r_at + ns * sr_n, mask=in_range, other=0) != 0)
    kv_ok = in_range[:, None] & d_ok[None, :]
    k = tl.load(k_at + ns[:, None] * sk_n, mask=kv_ok, other=0.0)
    v = tl.load(v_at + ns[:, None] * sv_n, mask=kv_ok, other=0.0)
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(ok[None, :], s * sc, float("-inf"))                         # (GB, BLOCK_N)
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                      # nothing seen yet: no NaN
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    l = l * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@jit
def softmax_split_kernel(
        q_ptr, k_ptr, v_ptr, n_ptr, real_ptr, scale_ptr, scale,
        m_ptr, l_ptr, acc_ptr,                  # partials (B*Hkv, splits, G) and (B*Hkv, splits, G, D), fp32
        Hkv, G, N, D,
        sq_b, sq_h, sq_d,                       # q (B, H, D)
        sk_b, sk_h, sk_n, sk_d,                 # cache_k (B, Hkv, N, D)
        sv_b, sv_h, sv_n, sv_d,                 # cache_v (B, Hkv, N, D)
        sr_b, sr_n,                             # key_real (B, N)
        HAS_N: tl.constexpr, HAS_REAL: tl.constexpr, SCALE_PTR: tl.constexpr, FP32_DOT: tl.constexpr,
        INTERPRET: tl.constexpr, KEYS_PER_SPLIT: tl.constexpr, GB: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = (row // Hkv).to(tl.int64)
    h = (row % Hkv).to(tl.int64)
    n = N
    if HAS_N:
        n = tl.minimum(tl.load(n_ptr + b), N).to(tl.int32)
    if SCALE_PTR:
        sc = tl.load(scale_ptr).to(tl.float32)
    else:
        sc = scale
    gs = tl.arange(0, GB)
    ds = tl.arange(0, BLOCK_D)
    g_ok = gs < G
    d_ok = ds < D
    q = tl.load(q_ptr + b * sq_b + (h * G + gs[:, None]) * sq_h + ds[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.full((GB,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GB,), dtype=tl.float32)
    acc = tl.zeros((GB, BLOCK_D), dtype=tl.float32)
    k_at = k_ptr + b * sk_b + h * sk_h + ds[None, :] * sk_d
    v_at = v_ptr + b * sv_b + h * sv_h + ds[None, :] * sv_d
    r_at = real_ptr + b * sr_b
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, n)
    if INTERPRET:   # a constant trip count and a test: Triton 3.6's interpreter cannot loop to a
        # runtime bound under numpy >= 2.4 (triton-lang/triton#9171)
        for i in range(0, KEYS_PER_SPLIT, BLOCK_N):
            if lo + i < hi:
                m, l, acc = _tile(q, k_at, v_at, r_at, lo + i, hi, sc, m, l, acc, d_ok, sk_n, sv_n, sr_n,
                                  HAS_REAL, FP32_DOT, BLOCK_N)
    else:           # to the row's length: the loads of a loop without a branch are pipelined
        for start in range(lo, hi, BLOCK_N):
            m, l, acc = _tile(q, k_at, v_at, r_at, start, hi, sc, m, l, acc, d_ok, sk_n, sv_n, sr_n,
                              HAS_REAL, FP32_DOT, BLOCK_N)
    part = (row * splits + split) * G + gs                                    # (GB,)
    tl.store(m_ptr + part, m, mask=g_ok)
    tl.store(l_ptr + part, l, mask=g_ok)
    tl.store(acc_ptr + part[:, None] * D + ds[None, :], acc, mask=g_ok[:, None] & d_ok[None, :] & (hi > lo))


@jit
def softmax_combine_kernel(
        m_ptr, l_ptr, acc_ptr, out_ptr, H, G, D, splits,
        so_b, so_h, so_d,                       # out (B, H, D)
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)                      # b * H + query head
    b = (pid // H).to(tl.int64)
    hq = pid % H
    row = pid // G                              # b * Hkv + kv head
    g = hq % G
    ss = tl.arange(0, BLOCK_S)
    ds = tl.arange(0, BLOCK_D)
    s_ok = ss < splits
    d_ok = ds < D
    part = (row * splits + ss) * G + g
    m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))                # 0 for the splits with no key
    seen = m > float("-inf")
    acc = tl.load(acc_ptr + part[:, None] * D + ds[None, :], mask=seen[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * so_b + hq * so_h + ds * so_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
