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

void quantize_x(const float *x, int xs, int B, int K, void *qx) {
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
    }
}

static inline size_t qblock_bytes(int type) {
    return type == T_Q8_0 ? 2 + QK : type == T_Q4_0 ? 2 + QK / 2 : 4 + QK / 2;
}

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

/* 16 bytes of nibbles -> 32 u8: low nibbles are weights 0..15, high nibbles 16..31 */
static inline __m256i nibbles_u8(const unsigned char *qs) {   /* the 16 bytes in both halves, the upper shifted by 4 */
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0f));
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
    if (type == T_Q4_1) {
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
    } else {
        w = nibbles_u8(blk + 4);
        s = dpbusd(_mm256_setzero_si256(), w, x);
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcastss_ps(scale), acc);
}
#endif

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
        __m128 m0[4], m1[4];   /* q4_1: lane 1 sums m_k * dx_k * sum(qx_k) */
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
            float mt = type == T_Q4_1 ? _mm_cvtss_f32(_mm_shuffle_ps(_mm_add_ps(m0[j], m1[j]), _mm_add_ps(m0[j], m1[j]), 1)) : 0.0f;
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
                } else {
                    const unsigned char *qs = blk + (type == T_Q4_1 ? 4 : 2);
                    for (int i = 0; i < QK / 2; i++) s += (qs[i] & 0x0f) * x[i] + (qs[i] >> 4) * x[i + QK / 2];
                    if (type == T_Q4_0) s -= 8 * sx[j][k];
                }
                acc[j] += (dw * xds[j][2 * k]) * (float)s;
                if (type == T_Q4_1) mt0[j] += f16_at(blk + 2) * xds[j][2 * k + 1];
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
QROWS_OF(T_Q8_0) QROWS_OF(T_Q4_0) QROWS_OF(T_Q4_1)

void qmat_rows(const Mat *m, int r0, int r1, const void *qx, int B, float *out, int os, int add) {
    switch (m->type) {
    case T_Q8_0: qrows_T_Q8_0(m, r0, r1, qx, B, out, os, add); break;
    case T_Q4_0: qrows_T_Q4_0(m, r0, r1, qx, B, out, os, add); break;
    default: qrows_T_Q4_1(m, r0, r1, qx, B, out, os, add); break;
    }
}

/* For tests: out (B, rows) = m . x (B, cols), x rounded to q8 blocks into qx (B * qx_row_bytes(cols) bytes). */
void gen_qmatmul(const Mat *m, const float *x, int B, float *out, void *qx) {
    quantize_x(x, m->cols, B, m->cols, qx);
    qmat_rows(m, 0, m->rows, qx, B, out, m->rows, 0);
}
