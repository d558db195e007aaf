/* Quantized weights times activations rounded to q8 blocks: integer dot products, as llama.cpp.
 *
 * quantize_x rounds each 32-wide block of an activation row once per matmul: fp32 d = max|x| / 127,
 * q = round-half-even(x * (1 / d)) as int8 (the nearest-even rounding of the vector convert), the
 * block's integer sum (q4_0's offset) and d * sum (q4_1's minimum term). Layout of one row of K
 * inputs (qx_row_bytes apart): int8 q[K], then per block the pair float (d, d * sum), then int32
 * sum[K/32] (the pair is one 8-byte load next to a q4_1 block's (d, m) pair).
 *
 * qmat_rows then computes, per weight block k of row r and input row b, an exact int32 dot of the
 * block's integers with x's and scales it once:
 *   q8_0  w = dw * qw             out += dw * dx * sum(qw * qx)
 *   q4_0  w = dw * (qw - 8)       out += dw * dx * (sum(qw * qx) - 8 * sum(qx))
 *   q4_1  w = dw * qw + m         out += dw * dx * sum(qw * qx) + m * (dx * sum(qx))
 *   q5_0  w = dw * (qw - 16)      out += dw * dx * (sum(qw * qx) - 16 * sum(qx))     (qw 0..31: nibble | 5th bit)
 *   q5_1  w = dw * qw + m         as q4_1
 * engine/quant.py:linear_q8 is the PyTorch twin (tests hold them together). The integer dot is
 * one vpdpbusd (u8 x s8 -> i32) per block where the compiler targets AVX512-VNNI (+VL) or AVX-VNNI,
 * maddubs + madd on AVX2, scalar code otherwise; q8_0's signed weights go through the sign trick
 * (|w| as u8 times x with w's sign). The per-block scaling is an fp32 FMA into 8 lanes, two
 * accumulators per input alternating blocks; up to 4 inputs share each decoded weight block.
 */
#include <math.h>
#include <string.h>

#include "gen.h"

size_t qx_row_bytes(int K) {
    size_t n = (size_t)K + 12 * (size_t)(K / QK);
    return (n + 63) & ~(size_t)63;
}

/* For T_Q4_1R and T_Q5R matrices, block k's 32 bytes sit at byte 32 * k as always, but inside every full group
 * of 4 blocks the 16 low halves (x[0:16] of each block) come first, then the 16 high halves: the
 * order of a 64-byte run of 4 blocks' nibbles split into low and high nibbles (q41r_rows). */
static void group_halves(signed char *q, int nb) {
    signed char t[4 * QK];
    for (int g = 0; g + 4 <= nb; g += 4) {
        signed char *run = q + (size_t)g * QK;
        for (int b = 0; b < 4; b++) {
            memcpy(t + 16 * b, run + QK * b, 16);
            memcpy(t + 64 + 16 * b, run + QK * b + 16, 16);
        }
        memcpy(run, t, sizeof t);
    }
}

void quantize_x(const float *x, int xs, int B, int K, void *qx, int type) {
    const int nb = K / QK;
    const size_t rs = qx_row_bytes(K);
    for (int b = 0; b < B; b++) {
        const float *xr = x + (size_t)b * xs;
        unsigned char *row = (unsigned char *)qx + (size_t)b * rs;
        signed char *q = (signed char *)row;
        float *ds = (float *)(row + K);            /* (d, d * sum) per block */
        int32_t *sum = (int32_t *)(ds + 2 * nb);
        for (int k = 0; k < nb; k++) {
            const float *v = xr + k * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            float dk = amax / 127.0f, id = dk != 0.0f ? 1.0f / dk : 0.0f;
            __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));   /* nearest even */
            __m512i ic = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(q + k * QK), _mm512_cvtsepi32_epi8(ia));
            _mm_storeu_si128((__m128i *)(q + k * QK + 16), _mm512_cvtsepi32_epi8(ic));
            sum[k] = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ic));
            ds[2 * k] = dk;
            ds[2 * k + 1] = dk * (float)sum[k];
#else
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float dk = amax / 127.0f, id = dk != 0.0f ? 1.0f / dk : 0.0f;
            int32_t s = 0;
            for (int i = 0; i < QK; i++) {
                int qi = (int)nearbyintf(v[i] * id);   /* the default rounding mode: nearest even */
                q[k * QK + i] = (signed char)qi;
                s += qi;
            }
            sum[k] = s;
            ds[2 * k] = dk;
            ds[2 * k + 1] = dk * (float)s;
#endif
        }
        if (type == T_Q4_1R || type == T_Q5R) group_halves(q, nb);
    }
}

static inline size_t qblock_bytes(int type) { return qk_block_bytes(type); }
static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q5_1; }   /* w = d q + m */

static inline float f16_at(const unsigned char *p) {   /* an fp16 scale, inline (F16C where targeted) */
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef GEN_X86
    return _cvtsh_ss(h);
#else
    return load_f16(h);
#endif
}

#ifdef GEN_X86
/* 8 int32 lanes += u8 x s8 products of 32 bytes (4 per lane) */
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else   /* |u * s| <= 128 * 127: maddubs' int16 pairs cannot saturate */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
#endif

/* One weight block's integer dot with input j's block k, scaled, into acc; q4_1's m * (dx * sum)
 * goes to lane 1 of macc (the fp16 (d, m) pair times x's (d, d * sum) pair: one multiply). */
#ifdef GEN_X86
static inline __attribute__((always_inline)) __m256 qblock(const unsigned char *blk, const signed char *xq,
                                                          const float *xds, int32_t sx, __m256 acc, __m128 *macc,
                                                          const int type) {
    __m256i w, x = _mm256_loadu_si256((const __m256i *)xq), s;
    __m128 scale;
    if (has_min(type)) {
        uint32_t dm;
        memcpy(&dm, blk, 4);
        __m128 p = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)),
                              _mm_castpd_ps(_mm_load_sd((const double *)xds)));    /* (dw * dx, m * dx * sum) */
        *macc = _mm_add_ps(*macc, p);
        scale = p;
    } else {
        uint16_t dw;
        memcpy(&dw, blk, 2);
        scale = _mm_mul_ss(_mm_cvtph_ps(_mm_cvtsi32_si128(dw)), _mm_load_ss(xds));
    }
    if (type == T_Q8_0) {
        w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        s = dpbusd(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    } else if (type == T_Q4_0) {   /* sum (q - 8) x = sum q x - 8 sum x: the offset starts lane 0 */
        w = nibbles_u8(blk + 2);
        s = dpbusd(_mm256_zextsi128_si256(_mm_cvtsi32_si128(-8 * sx)), w, x);
    } else if (type == T_Q5_0) {   /* the same with q's 5th bit from qh, offset 16 */
        w = _mm256_or_si256(nibbles_u8(blk + 6), q5_high8(load_u32(blk + 2)));
        s = dpbusd(_mm256_zextsi128_si256(_mm_cvtsi32_si128(-16 * sx)), w, x);
    } else if (type == T_Q5_1) {
        w = _mm256_or_si256(nibbles_u8(blk + 8), q5_high8(load_u32(blk + 4)));
        s = dpbusd(_mm256_setzero_si256(), w, x);
    } else {
        w = nibbles_u8(blk + 4);
        s = dpbusd(_mm256_setzero_si256(), w, x);
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcastss_ps(scale), acc);
}
#endif

/* ------------------------------------------------------------------ K-quants
 * A super-block of 256 weights is 8 sub-blocks of 32, each against the input's q8 block of the same
 * 32 columns (the activations are rounded as for every other kind), as exact int32 dots:
 *   q4_k, q5_k  out += (d sc_j) dx_j sum(q qx) - (dmin m_j) (dx_j sum(qx))    (q 0..15 / 0..31)
 *   q6_k        out += d dx_j (s_2j sum16(q - 32, qx) + s_2j+1 sum16'(q - 32, qx))
 * (llama.cpp rounds the activations to one scale per 256, block_q8_K, and sums the whole super-block
 * in integers; here each 32 keeps its own scale, as the 32-wide kinds: one activation rounding for
 * every matrix of a step.) On x86 the 8 sub-blocks' integer dots end up in the 8 lanes of one vector
 * (sum8x8), scaled by one multiply and one FMA per super-block and input. */
#ifdef GEN_X86
static inline __m256i sum8x8(const __m256i s[8]) {   /* lane k = the sum of s[k]'s 8 lanes */
    const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* 8 (d, d * sum) pairs -> the 8 d in one vector, the 8 d * sum in another */
static inline void split_pairs(const float *ds, __m256 *d, __m256 *dsum) {
    const __m256 a = _mm256_loadu_ps(ds), b = _mm256_loadu_ps(ds + 8);
    *d = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
    *dsum = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}
#endif

static inline __attribute__((always_inline)) void ktile(const Mat *m, int r0, int r1, const unsigned char *qx,
                                                       size_t rs, const int n, float *out, int os, int add,
                                                       const int type) {
    const int K = m->cols, nsb = K / QK_K;
    const size_t bb = kblock_bytes(type), stride = (size_t)nsb * bb;
    const signed char *xq[4];
    const float *xds[4];
    for (int j = 0; j < n; j++) {
        xq[j] = (const signed char *)(qx + j * rs);
        xds[j] = (const float *)(qx + j * rs + K);
    }
    for (int r = r0; r < r1; r++) {
        const unsigned char *row = (const unsigned char *)m->data + (size_t)r * stride;
#ifdef GEN_X86
        __m256 acc[4], macc[4];   /* per input: the sub-blocks' scaled dots, their min terms */
        for (int j = 0; j < 4; j++) acc[j] = macc[j] = _mm256_setzero_ps();
        for (int sb = 0; sb < nsb; sb++) {
            const unsigned char *blk = row + (size_t)sb * bb;
            __m256i w[8], sc16[8];
            __m256 scale, mins = _mm256_setzero_ps();
            if (type == T_Q6_K) {
                const signed char *sc = (const signed char *)(blk + 192);
                scale = _mm256_set1_ps(f16_at(blk + 208));
                const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
                for (int h = 0; h < 2; h++) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                    for (int g = 0; g < 4; g++) {
                        const __m256i l = g % 2 ? l1 : l0;
                        const __m256i lo = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), m4);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), m2);
                        w[4 * h + g] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                        sc16[4 * h + g] = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * g + 1]),
                                                           _mm_set1_epi16(sc[8 * h + 2 * g]));
                    }
                }
            } else {
                uint64_t sc, mn;   /* the 8 scales, the 8 mins, a byte each */
                k_scales_mins(blk + 4, &sc, &mn);
                scale = _mm256_mul_ps(_mm256_set1_ps(f16_at(blk)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
                mins = _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 2)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
                const unsigned char *qs = blk + (type == T_Q5_K ? 48 : 16);
                const __m256i m4 = _mm256_set1_epi8(0x0f);
                const __m256i qh = type == T_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
                    w[2 * p] = _mm256_and_si256(q, m4);
                    w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                }
                if (type == T_Q5_K)
                    for (int j = 0; j < 8; j++) {   /* bit j of qh's byte l is weight l's 5th bit: 16 or 0 */
                        const __m256i bit = _mm256_set1_epi8((char)(1 << j));
                        w[j] = _mm256_or_si256(w[j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                                      _mm256_set1_epi8(16)));
                    }
            }
            for (int j = 0; j < n; j++) {
                const signed char *x = xq[j] + (size_t)sb * QK_K;
                __m256i s[8];
                for (int k = 0; k < 8; k++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + QK * k));
                    if (type == T_Q6_K) {   /* (q - 32) x in int16 pairs (|.| <= 8128), times the 16s' scales */
                        const __m256i t = _mm256_sub_epi16(_mm256_maddubs_epi16(w[k], xv),
                                                           _mm256_maddubs_epi16(_mm256_set1_epi8(32), xv));
                        s[k] = _mm256_madd_epi16(t, sc16[k]);
                    } else {
                        s[k] = dpbusd(_mm256_setzero_si256(), w[k], xv);
                    }
                }
                __m256 dx, dxs;
                split_pairs(xds[j] + 16 * sb, &dx, &dxs);
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(s)), _mm256_mul_ps(scale, dx), acc[j]);
                if (type != T_Q6_K) macc[j] = _mm256_fmadd_ps(mins, dxs, macc[j]);
            }
        }
        for (int j = 0; j < n; j++) {
            const float v = hsum8(acc[j]) - (type == T_Q6_K ? 0.0f : hsum8(macc[j]));
            float *o = out + (size_t)j * os + (r - r0);
            *o = add ? *o + v : v;
        }
#else
        float acc[4] = {0, 0, 0, 0}, macc[4] = {0, 0, 0, 0};
        for (int sb = 0; sb < nsb; sb++) {
            const unsigned char *blk = row + (size_t)sb * bb;
            for (int k = 0; k < 8; k++) {
                int q[QK], s16[2] = {0, 0}, sc = 0, mn = 0;
                float scale;
                if (type == T_Q6_K) {
                    const int h = k / 4, g = k % 4;
                    const unsigned char *ql = blk + 64 * h + 32 * (g % 2), *qh = blk + 128 + 32 * h;
                    for (int i = 0; i < QK; i++)
                        q[i] = (((ql[i] >> (4 * (g / 2))) & 15) | (((qh[i] >> (2 * g)) & 3) << 4)) - 32;
                    s16[0] = ((const signed char *)(blk + 192))[8 * h + 2 * g];
                    s16[1] = ((const signed char *)(blk + 192))[8 * h + 2 * g + 1];
                    scale = f16_at(blk + 208);
                } else {
                    k_scale_min(blk + 4, k, &sc, &mn);
                    const unsigned char *qs = blk + (type == T_Q5_K ? 48 : 16) + 32 * (k / 2);
                    for (int i = 0; i < QK; i++) {
                        q[i] = (qs[i] >> (4 * (k % 2))) & 15;
                        if (type == T_Q5_K) q[i] |= ((blk[16 + i] >> k) & 1) << 4;
                    }
                    scale = f16_at(blk) * (float)sc;
                }
                const int kb = sb * 8 + k;
                for (int j = 0; j < n; j++) {
                    const signed char *x = xq[j] + (size_t)kb * QK;
                    int32_t a = 0, b = 0;
                    for (int i = 0; i < 16; i++) a += q[i] * x[i];
                    for (int i = 16; i < QK; i++) b += q[i] * x[i];
                    const int32_t dot = type == T_Q6_K ? s16[0] * a + s16[1] * b : a + b;
                    acc[j] += (scale * xds[j][2 * kb]) * (float)dot;
                    if (type != T_Q6_K) macc[j] += (f16_at(blk + 2) * (float)mn) * xds[j][2 * kb + 1];
                }
            }
        }
        for (int j = 0; j < n; j++) {
            const float v = acc[j] - macc[j];
            float *o = out + (size_t)j * os + (r - r0);
            *o = add ? *o + v : v;
        }
#endif
    }
}

#define KROWS_OF(T) static void qrows_##T(const Mat *m, int r0, int r1, const void *qx, int B, float *out,  \
                                          int os, int add) {                                              \
        const size_t rs = qx_row_bytes(m->cols);                                                     \
        const unsigned char *q = qx;                                                                 \
        int b = 0;                                                                                   \
        for (; b + 4 <= B; b += 4) ktile(m, r0, r1, q + b * rs, rs, 4, out + (size_t)b * os, os, add, T); \
        switch (B - b) {                                                                             \
        case 3: ktile(m, r0, r1, q + b * rs, rs, 3, out + (size_t)b * os, os, add, T); break;        \
        case 2: ktile(m, r0, r1, q + b * rs, rs, 2, out + (size_t)b * os, os, add, T); break;        \
        case 1: ktile(m, r0, r1, q + b * rs, rs, 1, out + (size_t)b * os, os, add, T); break;        \
        default: break;                                                                              \
        }                                                                                            \
    }
KROWS_OF(T_Q4_K) KROWS_OF(T_Q5_K) KROWS_OF(T_Q6_K)

/* Rows [r0, r1) against n (1..4) quantized inputs; n and type are constants after inlining. Blocks go
 * in pairs, the even one into one accumulator, the odd one into another (no chain of dependent FMAs). */
static inline __attribute__((always_inline)) void qtile(const Mat *m, int r0, int r1, const unsigned char *qx,
                                                       size_t rs, const int n, float *out, int os, int add,
                                                       const int type) {
    const int K = m->cols, nb = K / QK;
    const size_t bb = qblock_bytes(type), stride = (size_t)nb * bb;
    const float *xds[4];
    const int32_t *sx[4];
    const signed char *xq[4];
    for (int j = 0; j < n; j++) {
        xq[j] = (const signed char *)(qx + j * rs);
        xds[j] = (const float *)(qx + j * rs + K);
        sx[j] = (const int32_t *)(xds[j] + 2 * nb);
    }
    for (int r = r0; r < r1; r++) {
        const unsigned char *row = (const unsigned char *)m->data + (size_t)r * stride;
#ifdef GEN_X86
        __m256 a0[4], a1[4];
        __m128 m0[4], m1[4];   /* q4_1, q5_1: lane 1 sums m_k * dx_k * sum(qx_k) */
        for (int j = 0; j < 4; j++) {
            a0[j] = a1[j] = _mm256_setzero_ps();
            m0[j] = m1[j] = _mm_setzero_ps();
        }
        int k = 0;
        for (; k + 2 <= nb; k += 2) {
            const unsigned char *b0 = row + (size_t)k * bb, *b1 = b0 + bb;
            for (int j = 0; j < n; j++) {
                a0[j] = qblock(b0, xq[j] + k * QK, xds[j] + 2 * k, sx[j][k], a0[j], &m0[j], type);
                a1[j] = qblock(b1, xq[j] + (k + 1) * QK, xds[j] + 2 * k + 2, sx[j][k + 1], a1[j], &m1[j], type);
            }
        }
        if (k < nb) {
            const unsigned char *b0 = row + (size_t)k * bb;
            for (int j = 0; j < n; j++)
                a0[j] = qblock(b0, xq[j] + k * QK, xds[j] + 2 * k, sx[j][k], a0[j], &m0[j], type);
        }
        for (int j = 0; j < n; j++) {
            float mt = has_min(type) ? _mm_cvtss_f32(_mm_shuffle_ps(_mm_add_ps(m0[j], m1[j]), _mm_add_ps(m0[j], m1[j]), 1)) : 0.0f;
            float s = hsum8(_mm256_add_ps(a0[j], a1[j])) + mt;
            float *o = out + (size_t)j * os + (r - r0);
            *o = add ? *o + s : s;
        }
#else
        float acc[4] = {0, 0, 0, 0}, mt0[4] = {0, 0, 0, 0};
        for (int k = 0; k < nb; k++) {
            const unsigned char *blk = row + (size_t)k * bb;
            const float dw = f16_at(blk);
            for (int j = 0; j < n; j++) {
                const signed char *x = xq[j] + k * QK;
                int32_t s = 0;
                if (type == T_Q8_0) {
                    const signed char *wq = (const signed char *)(blk + 2);
                    for (int i = 0; i < QK; i++) s += wq[i] * x[i];
                } else if (type == T_Q5_0 || type == T_Q5_1) {
                    const int head = type == T_Q5_1 ? 8 : 6;
                    const unsigned char *qs = blk + head;
                    unsigned char high[QK];
                    q5_high(load_u32(blk + head - 4), high);
                    for (int i = 0; i < QK / 2; i++)
                        s += ((qs[i] & 0x0f) | high[i]) * x[i] + ((qs[i] >> 4) | high[i + QK / 2]) * x[i + QK / 2];
                    if (type == T_Q5_0) s -= 16 * sx[j][k];
                } else {
                    const unsigned char *qs = blk + (type == T_Q4_1 ? 4 : 2);
                    for (int i = 0; i < QK / 2; i++) s += (qs[i] & 0x0f) * x[i] + (qs[i] >> 4) * x[i + QK / 2];
                    if (type == T_Q4_0) s -= 8 * sx[j][k];
                }
                acc[j] += (dw * xds[j][2 * k]) * (float)s;
                if (has_min(type)) mt0[j] += f16_at(blk + 2) * xds[j][2 * k + 1];
            }
        }
        for (int j = 0; j < n; j++) {
            float s = acc[j] + mt0[j];
            float *o = out + (size_t)j * os + (r - r0);
            *o = add ? *o + s : s;
        }
#endif
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEN_Q41R 1
/* Up to 4 inputs as q8 blocks, for the grouped kernels: input j's integers and (d, d * sum) pairs. */
typedef struct { const signed char *q[4]; const float *ds[4]; } Q8In;

static inline __attribute__((always_inline)) Q8In q8_inputs(const unsigned char *qx, size_t rs, int n, int K) {
    Q8In in;
    for (int j = 0; j < n; j++) {
        in.q[j] = (const signed char *)(qx + j * rs);
        in.ds[j] = (const float *)(qx + j * rs + K);
    }
    return in;
}

/* q4_1 regrouped (T_Q4_1R): a row of nb blocks is every block's (d, m) f16 pair (4 * nb bytes), then
 * every block's 16 nibble bytes (16 * nb): the same 20 bytes a block. A group of 4 blocks is one
 * 64-byte load whose low nibbles are the 4 blocks' weights 0..15 and high nibbles their weights
 * 16..31, against x's grouped halves (quantize_x): two vpdpbusd give 16 int32 lanes, 4 per block;
 * the 4 blocks' (d * dx) spread to their lanes by one permute, one FMA, and the 4 pairs' m * dx *
 * sum(qx) in the odd lanes of one multiply. About a quarter of the instructions of qblock per
 * block. Blocks past the last full group go one at a time in 128-bit lanes (their x halves are in
 * natural order). Exact int32 dots; the fp32 sums per (row, input) do not depend on the batch.
 * five: q5 regrouped (T_Q5R), 24 bytes a block: every (d, m) pair (q5_0's as m = -16 d: d (q - 16) =
 * d q - 16 d), then every block's qh, the 4 of a full group as their low 16 bits (the 5th bits of the
 * weights in the group load's low nibbles, one 64-bit mask) then their high 16 bits (a mask for the
 * high nibbles), past the last group as stored; then every nibble block. Each mask adds 16 to its
 * bytes (one masked add per 64 weights), then the same dots as q4_1's. */
static inline __attribute__((always_inline)) void q41r_tile(const Mat *m, int r0, int r1, const unsigned char *qx,
                                                           size_t rs, const int n, float *out, int os, int add,
                                                           const int five) {
    const int K = m->cols, nb = K / QK, ng = nb / 4;
    const size_t stride = (size_t)nb * (five ? 24 : 20);
    const Q8In in = q8_inputs(qx, rs, n, K);
    const __m512i lo4 = _mm512_set1_epi8(0x0f), b16 = _mm512_set1_epi8(16);
    const __m128i lo4x = _mm_set1_epi8(0x0f), b16x = _mm_set1_epi8(16);
    const __m512i spread = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    for (int r = r0; r < r1; r++) {
        const unsigned char *row = (const unsigned char *)m->data + (size_t)r * stride;
        const unsigned char *dm = row, *qh = row + 4 * (size_t)nb, *qs = row + (five ? 8 : 4) * (size_t)nb;
        __m512 acc[4];                /* per input: the groups' sums, 16 lanes */
        __m256 macc[4];               /* odd lanes: the groups' m * dx * sum(qx) */
        __m128 tacc[4], tm[4];        /* the blocks past the last group: sums, m terms (lane 1) */
        for (int j = 0; j < 4; j++) {
            acc[j] = _mm512_setzero_ps();
            macc[j] = _mm256_setzero_ps();
            tacc[j] = tm[j] = _mm_setzero_ps();
        }
        for (int g = 0; g < ng; g++) {
            const __m512i z = _mm512_loadu_si512(qs + 64 * (size_t)g);
            __m512i lo = _mm512_and_si512(z, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), lo4);
            if (five) {   /* the 4 blocks' 5th bits of weights 0..15, then of 16..31: one mask each */
                uint64_t ml, mh;
                memcpy(&ml, qh + 16 * (size_t)g, 8);
                memcpy(&mh, qh + 16 * (size_t)g + 8, 8);
                lo = _mm512_mask_add_epi8(lo, (__mmask64)ml, lo, b16);
                hi = _mm512_mask_add_epi8(hi, (__mmask64)mh, hi, b16);
            }
            const __m256 dmf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 16 * (size_t)g)));
            for (int j = 0; j < n; j++) {
                const signed char *xg = in.q[j] + 128 * (size_t)g;
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xg));
                s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(xg + 64));
                const __m256 p = _mm256_mul_ps(dmf, _mm256_loadu_ps(in.ds[j] + 8 * g));   /* (d dx, m dx sum) x 4 */
                macc[j] = _mm256_add_ps(macc[j], p);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                         _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(p)), acc[j]);
            }
        }
        for (int k = 4 * ng; k < nb; k++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 16 * (size_t)k));
            __m128i lo = _mm_and_si128(q, lo4x), hi = _mm_and_si128(_mm_srli_epi16(q, 4), lo4x);
            if (five) {
                const uint32_t h = load_u32(qh + 4 * (size_t)k);
                lo = _mm_mask_add_epi8(lo, (__mmask16)(h & 0xffff), lo, b16x);
                hi = _mm_mask_add_epi8(hi, (__mmask16)(h >> 16), hi, b16x);
            }
            uint32_t pair;
            memcpy(&pair, dm + 4 * (size_t)k, 4);
            const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)pair));
            for (int j = 0; j < n; j++) {
                const signed char *xb = in.q[j] + (size_t)k * QK;
                __m128i s = _mm_dpbusd_epi32(_mm_setzero_si128(), lo, _mm_loadu_si128((const __m128i *)xb));
                s = _mm_dpbusd_epi32(s, hi, _mm_loadu_si128((const __m128i *)(xb + 16)));
                const __m128 p = _mm_mul_ps(dmf, _mm_castpd_ps(_mm_load_sd((const double *)(in.ds[j] + 2 * k))));
                tm[j] = _mm_add_ps(tm[j], p);
                tacc[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_broadcastss_ps(p), tacc[j]);
            }
        }
        for (int j = 0; j < n; j++) {
            float mo[8], to[4], tmo[4];
            _mm256_storeu_ps(mo, macc[j]);
            _mm_storeu_ps(to, tacc[j]);
            _mm_storeu_ps(tmo, tm[j]);
            const float mt = ((mo[1] + mo[3]) + (mo[5] + mo[7])) + tmo[1];
            const float s = hsum16(acc[j]) + ((to[0] + to[1]) + (to[2] + to[3])) + mt;
            float *o = out + (size_t)j * os + (r - r0);
            *o = add ? *o + s : s;
        }
    }
}

/* q8_0 regrouped (T_Q8_0R): a row of nb blocks is every block's f16 d (2 * nb bytes), then every
 * block's 32 int8 weights (engine.quant.group_rows only moves bytes), read as w + 128 (u8: vpdpbusd's
 * unsigned side; one XOR of the top bit per 64-byte load, no sign trick per input). Two 64-byte
 * loads hold 4 blocks; d * dx spreads to each block's 8 lanes, and the offset comes back as
 * -128 * d * (dx * sum(qx)), one multiply per 4 blocks (odd lanes of p). Blocks past the last full
 * group of 4 go one at a time in 256-bit lanes. x in natural order. */
static inline __attribute__((always_inline)) void q80r_tile(const Mat *m, int r0, int r1, const unsigned char *qx,
                                                           size_t rs, const int n, float *out, int os, int add) {
    const int K = m->cols, nb = K / QK, ng = nb / 4;
    const size_t stride = (size_t)nb * 34;
    const __m256i dup = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i spread0 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i spread1 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i top = _mm512_set1_epi8((char)0x80);   /* int8 w -> u8 w + 128 */
    const Q8In in = q8_inputs(qx, rs, n, K);
    for (int r = r0; r < r1; r++) {
        const unsigned char *row = (const unsigned char *)m->data + (size_t)r * stride;
        const unsigned char *ds = row, *qs = row + 2 * (size_t)nb;
        __m512 acc[4];
        __m256 macc[4], tacc[4], tm[4];
        for (int j = 0; j < 4; j++) {
            acc[j] = _mm512_setzero_ps();
            macc[j] = tacc[j] = tm[j] = _mm256_setzero_ps();
        }
        for (int g = 0; g < ng; g++) {
            const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(qs + 128 * (size_t)g), top),
                          w1 = _mm512_xor_si512(_mm512_loadu_si512(qs + 128 * (size_t)g + 64), top);
            const __m256 d = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(ds + 8 * (size_t)g)))), dup);
            for (int j = 0; j < n; j++) {
                const signed char *xg = in.q[j] + 128 * (size_t)g;
                const __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xg));
                const __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, _mm512_loadu_si512(xg + 64));
                const __m256 p = _mm256_mul_ps(d, _mm256_loadu_ps(in.ds[j] + 8 * g));   /* (d dx, d dx sum) x 4 */
                macc[j] = _mm256_add_ps(macc[j], p);
                const __m512 p5 = _mm512_castps256_ps512(p);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_permutexvar_ps(spread0, p5), acc[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_permutexvar_ps(spread1, p5), acc[j]);
            }
        }
        for (int k = 4 * ng; k < nb; k++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 32 * (size_t)k)),
                                               _mm512_castsi512_si256(top));
            uint16_t dh;
            memcpy(&dh, ds + 2 * (size_t)k, 2);
            const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(dh));
            for (int j = 0; j < n; j++) {
                const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w,
                                                      _mm256_loadu_si256((const __m256i *)(in.q[j] + (size_t)k * QK)));
                const __m128 p = _mm_mul_ps(_mm_shuffle_ps(d, d, 0), _mm_castpd_ps(_mm_load_sd((const double *)(in.ds[j] + 2 * k))));
                tm[j] = _mm256_add_ps(tm[j], _mm256_zextps128_ps256(p));
                tacc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcastss_ps(p), tacc[j]);
            }
        }
        for (int j = 0; j < n; j++) {
            float mo[8], tmo[8];
            _mm256_storeu_ps(mo, macc[j]);
            _mm256_storeu_ps(tmo, tm[j]);
            const float offset = -128.0f * (((mo[1] + mo[3]) + (mo[5] + mo[7])) + tmo[1]);
            const float s = hsum16(acc[j]) + hsum8(tacc[j]) + offset;
            float *o = out + (size_t)j * os + (r - r0);
            *o = add ? *o + s : s;
        }
    }
}

/* Inputs in tiles of 4 (the last tile 1-3) through TILE: the grouped kernels' batch loop. */
#define QROWS_GROUPED(NAME, TILE)                                                                      \
    static void NAME(const Mat *m, int r0, int r1, const void *qx, int B, float *out, int os, int add) { \
        const size_t rs = qx_row_bytes(m->cols);                                                   \
        const unsigned char *q = qx;                                                               \
        int b = 0;                                                                                 \
        for (; b + 4 <= B; b += 4) TILE(m, r0, r1, q + b * rs, rs, 4, out + (size_t)b * os, os, add); \
        switch (B - b) {                                                                           \
        case 3: TILE(m, r0, r1, q + b * rs, rs, 3, out + (size_t)b * os, os, add); break;          \
        case 2: TILE(m, r0, r1, q + b * rs, rs, 2, out + (size_t)b * os, os, add); break;          \
        case 1: TILE(m, r0, r1, q + b * rs, rs, 1, out + (size_t)b * os, os, add); break;          \
        default: break;                                                                            \
        }                                                                                          \
    }
static inline __attribute__((always_inline)) void q41r_only(const Mat *m, int r0, int r1, const unsigned char *qx,
                                                           size_t rs, const int n, float *out, int os, int add) {
    q41r_tile(m, r0, r1, qx, rs, n, out, os, add, 0);
}
static inline __attribute__((always_inline)) void q5r_tile(const Mat *m, int r0, int r1, const unsigned char *qx,
                                                          size_t rs, const int n, float *out, int os, int add) {
    q41r_tile(m, r0, r1, qx, rs, n, out, os, add, 1);
}
QROWS_GROUPED(qrows_q80r, q80r_tile)
QROWS_GROUPED(qrows_q41r, q41r_only)
QROWS_GROUPED(qrows_q5r, q5r_tile)
#endif

/* 1 where this build runs T_Q4_1R, T_Q8_0R and T_Q5R matrices (AVX-512 VNNI): the Python side regroups only then. */
int gen_has_q4_1r(void) {
#ifdef GEN_Q41R
    return 1;
#else
    return 0;
#endif
}

static inline __attribute__((always_inline)) void qrows_typed(const Mat *m, int r0, int r1, const void *qx, int B,
                                                             float *out, int os, int add, const int type) {
    const size_t rs = qx_row_bytes(m->cols);
    const unsigned char *q = qx;
    int b = 0;
    for (; b + 4 <= B; b += 4) qtile(m, r0, r1, q + b * rs, rs, 4, out + (size_t)b * os, os, add, type);
    switch (B - b) {
    case 3: qtile(m, r0, r1, q + b * rs, rs, 3, out + (size_t)b * os, os, add, type); break;
    case 2: qtile(m, r0, r1, q + b * rs, rs, 2, out + (size_t)b * os, os, add, type); break;
    case 1: qtile(m, r0, r1, q + b * rs, rs, 1, out + (size_t)b * os, os, add, type); break;
    default: break;
    }
}

#define QROWS_OF(T) static void qrows_##T(const Mat *m, int r0, int r1, const void *qx, int B, float *out, int os, \
                                          int add) { qrows_typed(m, r0, r1, qx, B, out, os, add, T); }
QROWS_OF(T_Q8_0) QROWS_OF(T_Q4_0) QROWS_OF(T_Q4_1) QROWS_OF(T_Q5_0) QROWS_OF(T_Q5_1)

void qmat_rows(const Mat *m, int r0, int r1, const void *qx, int B, float *out, int os, int add) {
    switch (m->type) {
    case T_Q8_0: qrows_T_Q8_0(m, r0, r1, qx, B, out, os, add); break;
    case T_Q4_0: qrows_T_Q4_0(m, r0, r1, qx, B, out, os, add); break;
    case T_Q5_0: qrows_T_Q5_0(m, r0, r1, qx, B, out, os, add); break;
    case T_Q5_1: qrows_T_Q5_1(m, r0, r1, qx, B, out, os, add); break;
    case T_Q4_K: qrows_T_Q4_K(m, r0, r1, qx, B, out, os, add); break;
    case T_Q5_K: qrows_T_Q5_K(m, r0, r1, qx, B, out, os, add); break;
    case T_Q6_K: qrows_T_Q6_K(m, r0, r1, qx, B, out, os, add); break;
#ifdef GEN_Q41R
    case T_Q4_1R: qrows_q41r(m, r0, r1, qx, B, out, os, add); break;
    case T_Q5R: qrows_q5r(m, r0, r1, qx, B, out, os, add); break;
    case T_Q8_0R: qrows_q80r(m, r0, r1, qx, B, out, os, add); break;
#endif
    default: qrows_T_Q4_1(m, r0, r1, qx, B, out, os, add); break;
    }
}

/* For tests: out (B, rows) = m . x (B, cols), x rounded to q8 blocks into qx (B * qx_row_bytes(cols) bytes). */
void gen_qmatmul(const Mat *m, const float *x, int B, float *out, void *qx) {
    quantize_x(x, m->cols, B, m->cols, qx, m->type);
    qmat_rows(m, 0, m->rows, qx, B, out, m->rows, 0);
}
