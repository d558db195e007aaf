/* Row dot products for every weight type, rms_norm and the 16-bit conversions.
 *
 * mat_rows computes out[b][r] = W[r] . x[b] for a range of rows and a batch of inputs. Float
 * weights (fp32, f16, bf16) go through register tiles of R rows against N inputs (below, "float
 * weights, any batch"); where the compiler targets AVX-512, through tile.c's tiles instead.
 * Quantized rows are decoded a 32-wide block at a time to fp32 (w = d*q, d*(q-8), d*q + m, d*(q-16)
 * exactly as engine/quant.py dequantizes) and used for up to 3 inputs, so a batch reads the weights once.
 * Accumulation is fp32 in a fixed order per (row, input): results do not depend on the batch,
 * threads or chunking. x86 intrinsics where the compiler targets AVX2/F16C, portable scalar code
 * otherwise.
 */
#include <math.h>
#include <string.h>

#include "gen.h"


/* ------------------------------------------------------------------ 16-bit floats */
/* inline here (load_f16 is exported, so a call through the PLT: it clobbers every vector register) */
static inline float f16f(uint16_t h) {
#ifdef GEN_X86
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) u = s;
        else { e = 127 - 14; while (!(m & 0x400)) { m <<= 1; e--; } u = s | e << 23 | (m & 0x3ff) << 13; }
    } else if (e == 31) u = s | 0x7f800000 | m << 13;
    else u = s | (e + 112) << 23 | m << 13;
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float load_f16(uint16_t h) { return f16f(h); }

uint16_t store_f16(float f) {   /* round to nearest even, as torch's .to(float16) */
#ifdef GEN_X86
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
#endif
}

float load_bf16(uint16_t h) { return bf16f(h); }

uint16_t store_bf16(float f) {  /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

void load_row(const void *base, int type, size_t at, int n, float *dst) {
    if (type == T_F32) { memcpy(dst, (const float *)base + at, (size_t)n * 4); return; }
    const uint16_t *h = (const uint16_t *)base + at;
    int i = 0;
#ifdef GEN_X86
    if (type == T_F16)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    else
        for (; i + 8 <= n; i += 8) {
            __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
        }
#endif
    if (type == T_F16) for (; i < n; i++) dst[i] = load_f16(h[i]);
    else for (; i < n; i++) dst[i] = load_bf16(h[i]);
}

void store_row(void *base, int type, size_t at, int n, const float *src) {
    if (type == T_F32) { memcpy((float *)base + at, src, (size_t)n * 4); return; }
    uint16_t *h = (uint16_t *)base + at;
    if (type == T_F16) for (int i = 0; i < n; i++) h[i] = store_f16(src[i]);
    else for (int i = 0; i < n; i++) h[i] = store_bf16(src[i]);
}

/* ------------------------------------------------------------------ blocks */
/* The f16 scale stored (unaligned) at p. */
static inline float f16_at(const unsigned char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return load_f16(h);
}

static size_t block_bytes(int type) {   /* K-quants: a super-block of 256 */
    return is_kquant(type) ? kblock_bytes(type) : qk_block_bytes(type);
}

/* Weights 32k..32k+31 of a K-quant row into f, as engine/quant.py's dequantize: q4_k / q5_k
 * (d*sc) * q - dmin*m (d*sc and (d*sc) * q are exact in fp32: one rounding, fused or not), q6_k
 * (d*s) * (q - 32). */
static inline void decode_ksub(const unsigned char *row, const int type, int k, float *f) {
    const unsigned char *sb = row + (size_t)(k / 8) * kblock_bytes(type);
    const int j = k % 8;
    if (type == T_Q6_K) {
        const int h = j / 4, g = j % 4;
        const unsigned char *ql = sb + 64 * h + 32 * (g % 2), *qh = sb + 128 + 32 * h;
        const signed char *sc = (const signed char *)(sb + 192) + 8 * h + 2 * g;
        const float d = f16_at(sb + 208), s0 = d * (float)sc[0], s1 = d * (float)sc[1];
        const int lo = 4 * (g / 2), hi = 2 * g;
        for (int i = 0; i < QK; i++) {
            const int q = ((ql[i] >> lo) & 15) | (((qh[i] >> hi) & 3) << 4);
            f[i] = (i < 16 ? s0 : s1) * (float)(q - 32);
        }
        return;
    }
    int sc, mn;
    k_scale_min(sb + 4, j, &sc, &mn);
    const float ds = f16_at(sb) * (float)sc, dm = f16_at(sb + 2) * (float)mn;
    const unsigned char *qs = sb + (type == T_Q5_K ? 48 : 16) + 32 * (j / 2), *qh = sb + 16;
    const int shift = 4 * (j % 2);
    for (int i = 0; i < QK; i++) {
        int q = (qs[i] >> shift) & 15;
        if (type == T_Q5_K) q |= ((qh[i] >> j) & 1) << 4;
        f[i] = ds * (float)q - dm;
    }
}

#ifdef GEN_X86
/* 16 bytes of nibbles -> 32 values as fp32: low nibbles are weights 0..15, high nibbles 16..31 */
static inline void nibbles(const unsigned char *qs, v8 w[4]) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#endif

#ifdef GEN_X86
/* decode_ksub in vectors: the same values (the same fp32 operations per weight) */
static inline __attribute__((always_inline)) void decode_ksub8(const unsigned char *row, const int type, int k,
                                                              v8 w[4]) {
    const unsigned char *sb = row + (size_t)(k / 8) * kblock_bytes(type);
    const int j = k % 8;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m128i part[4];
    if (type == T_Q6_K) {
        const int h = j / 4, g = j % 4;
        const signed char *sc = (const signed char *)(sb + 192) + 8 * h + 2 * g;
        const float d = f16_at(sb + 208), s0 = d * (float)sc[0], s1 = d * (float)sc[1];
        __m256i l = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32 * (g % 2)));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
        l = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), m4);
        hb = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), _mm256_set1_epi8(3));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        part[0] = lo, part[1] = _mm_srli_si128(lo, 8), part[2] = hi, part[3] = _mm_srli_si128(hi, 8);
        for (int i = 0; i < 4; i++)
            w[i] = (v8)_mm256_mul_ps(_mm256_set1_ps(i < 2 ? s0 : s1), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])));
        return;
    }
    int sc, mn;
    k_scale_min(sb + 4, j, &sc, &mn);
    const float ds = f16_at(sb) * (float)sc, dm = f16_at(sb + 2) * (float)mn;
    __m256i q = _mm256_loadu_si256((const __m256i *)(sb + (type == T_Q5_K ? 48 : 16) + 32 * (j / 2)));
    q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, m4);
    if (type == T_Q5_K) {   /* bit j of qh's byte i: weight i's 5th bit */
        const __m256i bit = _mm256_set1_epi8((char)(1 << j)), qh = _mm256_loadu_si256((const __m256i *)(sb + 16));
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(16)));
    }
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    part[0] = lo, part[1] = _mm_srli_si128(lo, 8), part[2] = hi, part[3] = _mm_srli_si128(hi, 8);
    for (int i = 0; i < 4; i++)   /* (d sc) q is exact: fused into the subtraction or not, one rounding */
        w[i] = (v8)_mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(ds), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i]))),
                                 _mm256_set1_ps(dm));
}
#endif

/* 32 q5 weights as fp32 in w[4]: q = the nibbles at qs (byte j: weight j low, j + 16 high) | bit j of h
 * << 4; w = d * (q - 16) (one == 0: q5_0) or d * q + m (q5_1; d * q is exact: one rounding, fused or not) */
static inline __attribute__((always_inline)) void decode_q5(float d, float m, const int one, uint32_t h,
                                                           const unsigned char *qs, v8 w[4]) {
#ifdef GEN_X86
    const __m256i q = _mm256_or_si256(nibbles_u8(qs), q5_high8(h));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i]));
        w[i] = one ? (v8)_mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), v), _mm256_set1_ps(m))
                   : (v8)_mm256_mul_ps(_mm256_set1_ps(d), _mm256_sub_ps(v, _mm256_set1_ps(16.0f)));
    }
#else
    float f[QK];
    unsigned char high[QK];
    q5_high(h, high);
    for (int i = 0; i < QK / 2; i++) {
        const int lo = (qs[i] & 0x0f) | high[i], hi = (qs[i] >> 4) | high[i + QK / 2];
        f[i] = one ? d * (float)lo + m : d * (float)(lo - 16);
        f[i + QK / 2] = one ? d * (float)hi + m : d * (float)(hi - 16);
    }
    for (int q = 0; q < 4; q++) w[q] = ld8(f + 8 * q);
#endif
}

/* Block k of a quantized row (32 consecutive weights from element 32k) as fp32 in w[4]. */
static inline __attribute__((always_inline)) void decode_block(const unsigned char *row, const int type, int k,
                                                              v8 w[4], int nb) {
    float f[QK] __attribute__((aligned(32)));
    if (type == T_Q5R) {   /* regrouped (qdot.c): (d, m) at 4k, qh at 4nb (per full group of 4 blocks their
                            * low 16 bits, then their high 16 bits; past the last group as stored), nibbles at 8nb + 16k */
        const unsigned char *qh = row + 4 * (size_t)nb;
        uint32_t h;
        if (k < nb / 4 * 4) {
            uint16_t lo, hi;
            memcpy(&lo, qh + 16 * (size_t)(k / 4) + 2 * (k % 4), 2);
            memcpy(&hi, qh + 16 * (size_t)(k / 4) + 8 + 2 * (k % 4), 2);
            h = lo | (uint32_t)hi << 16;
        } else {
            h = load_u32(qh + 4 * (size_t)k);
        }
        decode_q5(f16_at(row + 4 * (size_t)k), f16_at(row + 4 * (size_t)k + 2), 1, h, row + 8 * (size_t)nb + 16 * (size_t)k, w);
        return;
    }
    if (type == T_Q4_1R) {   /* regrouped (qdot.c): block k's (d, m) at 4k, its 16 nibble bytes at 4nb + 16k */
        const float d = f16_at(row + 4 * (size_t)k), m = f16_at(row + 4 * (size_t)k + 2);
        const unsigned char *qs = row + 4 * (size_t)nb + 16 * (size_t)k;
#ifdef GEN_X86
        nibbles(qs, w);
        for (int q = 0; q < 4; q++)
            w[q] = (v8)_mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), (__m256)w[q]), _mm256_set1_ps(m));
        return;
#else
        for (int i = 0; i < QK / 2; i++) {
            float lo = d * (float)(qs[i] & 0x0f), hi = d * (float)(qs[i] >> 4);
            f[i] = lo + m;
            f[i + QK / 2] = hi + m;
        }
        for (int q = 0; q < 4; q++) w[q] = ld8(f + 8 * q);
        return;
#endif
    }
    if (type == T_Q8_0R) {   /* regrouped (qdot.c): block k's d at 2k, its 32 int8 weights at 2nb + 32k */
        const float d = f16_at(row + 2 * (size_t)k);
        const signed char *qs = (const signed char *)row + 2 * (size_t)nb + QK * (size_t)k;
        for (int i = 0; i < QK; i++) f[i] = d * (float)qs[i];
        for (int q = 0; q < 4; q++) w[q] = ld8(f + 8 * q);
        return;
    }
    if (is_kquant(type)) {
#ifdef GEN_X86
        decode_ksub8(row, type, k, w);
#else
        decode_ksub(row, type, k, f);
        for (int q = 0; q < 4; q++) w[q] = ld8(f + 8 * q);
#endif
        return;
    }
    const unsigned char *blk = row + (size_t)k * block_bytes(type);
    switch (type) {
    case T_Q8_0: {
        const float d = f16_at(blk);
        const signed char *qs = (const signed char *)(blk + 2);
#ifdef GEN_X86
        for (int q = 0; q < 4; q++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * q))));
            w[q] = (v8)_mm256_mul_ps(_mm256_set1_ps(d), v);
        }
        return;
#else
        for (int i = 0; i < QK; i++) f[i] = d * (float)qs[i];
        break;
#endif
    }
    case T_Q4_0: {
        const float d = f16_at(blk);
        const unsigned char *qs = blk + 2;
#ifdef GEN_X86
        nibbles(qs, w);
        for (int q = 0; q < 4; q++) w[q] = (v8)_mm256_mul_ps(_mm256_set1_ps(d), _mm256_sub_ps((__m256)w[q], _mm256_set1_ps(8.0f)));
        return;
#else
        for (int i = 0; i < QK / 2; i++) {
            f[i] = d * (float)((int)(qs[i] & 0x0f) - 8);
            f[i + QK / 2] = d * (float)((int)(qs[i] >> 4) - 8);
        }
        break;
#endif
    }
    case T_Q5_0: case T_Q5_1: {   /* d (, m), qh, nibbles: w = d * (q - 16) or d * q + m, as Q4_0 / Q4_1 */
        const int one = type == T_Q5_1, head = one ? 8 : 6;
        decode_q5(f16_at(blk), one ? f16_at(blk + 2) : 0.0f, one, load_u32(blk + head - 4), blk + head, w);
        return;
    }
    default: {   /* T_Q4_1 */
        const float d = f16_at(blk), m = f16_at(blk + 2);
        const unsigned char *qs = blk + 4;
#ifdef GEN_X86
        nibbles(qs, w);
        for (int q = 0; q < 4; q++) {
            __m256 lo = _mm256_mul_ps(_mm256_set1_ps(d), (__m256)w[q]);   /* two roundings, as dequantize() */
            w[q] = (v8)_mm256_add_ps(lo, _mm256_set1_ps(m));
        }
        return;
#endif
        for (int i = 0; i < QK / 2; i++) {
            float lo = d * (float)(qs[i] & 0x0f), hi = d * (float)(qs[i] >> 4);
            f[i] = lo + m;
            f[i + QK / 2] = hi + m;
        }
        break;
    }
    }
    for (int q = 0; q < 4; q++) w[q] = ld8(f + 8 * q);
}

static inline size_t row_bytes(const Mat *m) {
    if (m->type <= T_BF16)   /* float rows need not be a multiple of 32 long */
        return (size_t)m->cols * (m->type == T_F32 ? 4 : 2);
    return (size_t)(m->cols / (is_kquant(m->type) ? QK_K : QK)) * block_bytes(m->type);
}

static inline const unsigned char *row_ptr(const Mat *m, int r) {
    return (const unsigned char *)m->data + (size_t)r * row_bytes(m);
}

static inline float tail_elem(const unsigned char *row, int type, int i) {
    if (type == T_F32) return ((const float *)row)[i];
    uint16_t h = ((const uint16_t *)row)[i];
    return type == T_F16 ? f16f(h) : bf16f(h);
}

/* Rows [r0, r1) against n (1..3) inputs; n and type are constants after inlining. */
static inline __attribute__((always_inline)) void rows_tile(const Mat *m, int r0, int r1, const float *x, int xs,
                                                           const int n, float *out, int os, int add, const int type) {
    const int nb = m->cols / QK;   /* quantized rows are whole blocks */
    const size_t stride = row_bytes(m);
    for (int r = r0; r < r1; r++) {
        const unsigned char *row = (const unsigned char *)m->data + (size_t)r * stride;
        v8 acc[3][4];
        for (int j = 0; j < n; j++)
            for (int q = 0; q < 4; q++) acc[j][q] = (v8){0};
        for (int k = 0; k < nb; k++) {
            v8 w[4];
            decode_block(row, type, k, w, nb);
            for (int j = 0; j < n; j++) {
                const float *xp = x + (size_t)j * xs + k * QK;
                for (int q = 0; q < 4; q++) acc[j][q] += w[q] * ld8(xp + 8 * q);
            }
        }
        for (int j = 0; j < n; j++) {
            float s = hsum((acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]));
            float *o = out + (size_t)j * os + (r - r0);
            *o = add ? *o + s : s;
        }
    }
}

/* Quantized rows [r0, r1) against B inputs, one row against up to 3 inputs at a time: 4 chains per input are
 * 12 accumulators, which fit (with the weight vector) in AVX2's 16 registers; a wider tile spilled
 * them (8 inputs: 20 live vectors). Batches go per 16-row block, so the block stays in L1 while the
 * batch passes over it. Every (row, input) sums in the same 4 chains and the same final adds
 * whatever B and its place in the batch: a sequence stepped alone and inside a batch gets the same
 * bits (as tile.c's AVX-512 tiles; tested). */
static inline __attribute__((always_inline)) void rows_typed(const Mat *m, int r0, int r1, const float *x, int xs,
                                                            int B, float *out, int os, int add, const int type) {
    for (int r = r0; r < r1; r += 16) {
        const int e = r + 16 < r1 ? r + 16 : r1;
        float *o = out + (r - r0);
        int b = 0;
        for (; b + 3 <= B; b += 3) rows_tile(m, r, e, x + (size_t)b * xs, xs, 3, o + (size_t)b * os, os, add, type);
        if (B - b == 2) rows_tile(m, r, e, x + (size_t)b * xs, xs, 2, o + (size_t)b * os, os, add, type);
        else if (B - b == 1) rows_tile(m, r, e, x + (size_t)b * xs, xs, 1, o + (size_t)b * os, os, add, type);
    }
}

/* ------------------------------------------------------------------ float weights, any batch
 * (where tile.c's AVX-512 tiles do not apply). A register tile is R rows against N inputs: per 8
 * columns it widens the R rows' weights once and does R*N FMAs (the one-row tiles of the quantized
 * path, 4 chains per input, did 4 + 12 loads for 12 FMAs; measured on tiny's f16 matrices, one
 * Zen 3 core, weights in cache: 15-27 GMAC/s at batch 1-16 before, 17-35 now, of a 50 peak).
 * Every (row, input) sums in ONE 8-lane FMA chain over its columns, then hsum's fixed tree, then
 * the last cols % 8 columns in order: the same operations whatever R, N, B, the row's place in
 * the batch or the chunking, so a sequence stepped alone and inside a batch gets the same bits
 * (tested). R*N accumulators and R weight vectors stay in AVX2's 16 registers (the inputs are the
 * FMAs' memory operands). */

static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(GEN_X86) && defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return c + a * b;
#endif
}

/* 8 weights of a float row from column k, as fp32 */
static inline __attribute__((always_inline)) v8 wload8(const unsigned char *row, int k, const int type) {
    if (type == T_F32) return ld8((const float *)row + k);
#ifdef GEN_X86
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    if (type == T_F16) return (v8)_mm256_cvtph_ps(h);
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = tail_elem(row, type, k + i);
    return ld8(f);
#endif
}

/* Rows w, w + stride, ... (R of them) against inputs x, x + xs, ... (N): out[n*os + r] (+)= w_r . x_n */
static inline __attribute__((always_inline)) void ftile(const unsigned char *w, size_t stride, int K,
                                                       const float *x, int xs, float *out, int os, int add,
                                                       const int R, const int N, const int type) {
    v8 acc[8][6];
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 6
        for (int n = 0; n < N; n++) acc[r][n] = (v8){0};
    const int K8 = K & ~7;
    for (int k = 0; k < K8; k += 8) {
        v8 wv[8];
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) wv[r] = wload8(w + (size_t)r * stride, k, type);
        #pragma GCC unroll 6
        for (int n = 0; n < N; n++) {
            const v8 xv = ld8(x + (size_t)n * xs + k);
            #pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][n] = fma8(wv[r], xv, acc[r][n]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const unsigned char *row = w + (size_t)r * stride;
        #pragma GCC unroll 6
        for (int n = 0; n < N; n++) {
            float s = hsum(acc[r][n]);
            for (int i = K8; i < K; i++) s += tail_elem(row, type, i) * x[(size_t)n * xs + i];
            float *o = out + (size_t)n * os + r;
            *o = add ? *o + s : s;
        }
    }
}

#define FROW_BLOCK 16   /* rows whose weights stay in L1 while every input group passes over them */

/* Rows [r0, r1) against N inputs: R(N) rows a tile, the last rows one at a time. */
static inline __attribute__((always_inline)) void ftiles(const unsigned char *base, size_t stride, int K, int r0,
                                                        int r1, const float *x, int xs, float *out, int os,
                                                        int add, const int N, const int type) {
    const int R = N == 1 ? 8 : N == 2 ? 4 : N <= 4 ? 3 : 2;
    int r = r0;
    for (; r + R <= r1; r += R) ftile(base + (size_t)r * stride, stride, K, x, xs, out + r, os, add, R, N, type);
    for (; r < r1; r++) ftile(base + (size_t)r * stride, stride, K, x, xs, out + r, os, add, 1, N, type);
}

static inline __attribute__((always_inline)) void frows_typed(const Mat *m, int r0, int r1, const float *x, int xs,
                                                             int B, float *out, int os, int add, const int type) {
    const size_t stride = row_bytes(m);
    const unsigned char *base = (const unsigned char *)m->data;
    const int groups = (B + 5) / 6;   /* inputs in groups of at most 6, as even as they go (16: 6, 5, 5) */
    out -= r0;
    for (int rb = r0; rb < r1; rb += FROW_BLOCK) {
        const int re = rb + FROW_BLOCK < r1 ? rb + FROW_BLOCK : r1;
        for (int g = 0, b = 0; g < groups; g++) {
            const int n = (B - b) / (groups - g);
            const float *xb = x + (size_t)b * xs;
            float *ob = out + (size_t)b * os;
            switch (n) {
            case 1: ftiles(base, stride, m->cols, rb, re, xb, xs, ob, os, add, 1, type); break;
            case 2: ftiles(base, stride, m->cols, rb, re, xb, xs, ob, os, add, 2, type); break;
            case 3: ftiles(base, stride, m->cols, rb, re, xb, xs, ob, os, add, 3, type); break;
            case 4: ftiles(base, stride, m->cols, rb, re, xb, xs, ob, os, add, 4, type); break;
            case 5: ftiles(base, stride, m->cols, rb, re, xb, xs, ob, os, add, 5, type); break;
            default: ftiles(base, stride, m->cols, rb, re, xb, xs, ob, os, add, 6, type); break;
            }
            b += n;
        }
    }
}

/* One specialised kernel per weight type. */
#define FROWS_OF(T) static void rows_##T(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, \
                                         int os, int add) { frows_typed(m, r0, r1, x, xs, B, out, os, add, T); }
#define ROWS_OF(T) static void rows_##T(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, \
                                        int os, int add) { rows_typed(m, r0, r1, x, xs, B, out, os, add, T); }
FROWS_OF(T_F32) FROWS_OF(T_F16) FROWS_OF(T_BF16) ROWS_OF(T_Q8_0) ROWS_OF(T_Q4_0) ROWS_OF(T_Q4_1)
ROWS_OF(T_Q4_K) ROWS_OF(T_Q5_K) ROWS_OF(T_Q6_K) ROWS_OF(T_Q4_1R) ROWS_OF(T_Q8_0R) ROWS_OF(T_Q5_0) ROWS_OF(T_Q5_1)
ROWS_OF(T_Q5R)

void mat_rows(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add) {
    if (tile_rows(m, r0, r1, x, xs, B, out, os, add)) return;   /* float weights on AVX-512: tile.c */
    switch (m->type) {
    case T_F32: rows_T_F32(m, r0, r1, x, xs, B, out, os, add); break;
    case T_F16: rows_T_F16(m, r0, r1, x, xs, B, out, os, add); break;
    case T_BF16: rows_T_BF16(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q8_0: rows_T_Q8_0(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q4_0: rows_T_Q4_0(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q4_K: rows_T_Q4_K(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q5_K: rows_T_Q5_K(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q6_K: rows_T_Q6_K(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q4_1R: rows_T_Q4_1R(m, r0, r1, x, xs, B, out, os, add); break;   /* fp32 activations, regrouped blocks */
    case T_Q8_0R: rows_T_Q8_0R(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q5_0: rows_T_Q5_0(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q5_1: rows_T_Q5_1(m, r0, r1, x, xs, B, out, os, add); break;
    case T_Q5R: rows_T_Q5R(m, r0, r1, x, xs, B, out, os, add); break;
    default: rows_T_Q4_1(m, r0, r1, x, xs, B, out, os, add); break;
    }
}

void row_to_f32(const Mat *m, int r, float *dst) {
    const unsigned char *row = row_ptr(m, r);
    if (m->type <= T_BF16) { load_row(row, m->type, 0, m->cols, dst); return; }
    for (int k = 0; k < m->cols / QK; k++) {
        v8 w[4];
        decode_block(row, m->type, k, w, m->cols / QK);
        memcpy(dst + k * QK, w, sizeof w);
    }
}

void rms_norm(float *out, const float *x, const void *w, int wtype, int n, float eps) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    if (wtype == T_F32) {
        const float *wf = (const float *)w;
        for (int i = 0; i < n; i++) out[i] = wf[i] * (x[i] * r);
        return;
    }
    float wf[64];   /* 16-bit weights widened 64 at a time (vector converts), then the same products */
    for (int i0 = 0; i0 < n; i0 += 64) {
        const int m = n - i0 < 64 ? n - i0 : 64;
        load_row(w, wtype, (size_t)i0, m, wf);
        for (int i = 0; i < m; i++) out[i0 + i] = wf[i] * (x[i0 + i] * r);
    }
}
