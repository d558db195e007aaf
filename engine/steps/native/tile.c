/* Float weights (fp32, f16, bf16) times a batch of fp32 inputs in AVX-512 register tiles.
 *
 * out[b][r] = W[r] . x[b] for rows [r0, r1) and B inputs. A tile is one row against up to 8
 * inputs: per 32 columns it loads the row's two weight vectors once (16-bit weights widened once)
 * and does 2 FMAs per input, the inputs' accumulators in zmm registers. Rows go in blocks of 16
 * (in L1 while a batch of 16 passes over them in two tiles of 8); a batch's tiles prefetch the
 * row PF_ROWS rows on (the hardware prefetcher stops at every 4 KiB page). One row per tile, not
 * several: several rows read side by side are several streams, and measured on tiny's matrices
 * out of L3 they ran 0.6-0.8x the speed of one (while 1.1x faster when the weights were in L2).
 *
 * Accuracy and determinism: every (row, input) sums in two fp32 FMA chains of 16 lanes (even and
 * odd 16-column steps, the last partial 16 columns through masked loads, zeros beyond), added,
 * then one fixed lane tree (lane j + j+8, + j+4, + j+2, + j+1), whatever the tile. So a row's
 * result does not depend on B, on its place in the batch, on the chunking or on the threads: a
 * sequence stepped alone and inside a batch gets bit-identical logits.
 *
 * Built only where the compiler targets AVX-512 (F, BW, VL); kernels.c's tiles otherwise.
 */
#include "gen.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PF_ROWS 4   /* a batch's tiles prefetch the row this many rows on (one input: the hardware's prefetch is as good) */

/* 16 weights from element k of a row, as fp32 (m: which lanes; 0xffff for a whole vector) */
static inline __attribute__((always_inline)) __m512 wload(const void *row, int k, __mmask16 m, const int type) {
    if (type == T_F32) return _mm512_maskz_loadu_ps(m, (const float *)row + k);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k);
    if (type == T_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));   /* bf16: the high half */
}

static inline __attribute__((always_inline)) __m512 wload_full(const void *row, int k, const int type) {
    if (type == T_F32) return _mm512_loadu_ps((const float *)row + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k));
    if (type == T_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row w against inputs x[0..NB-1] (xs apart): out[j*os] (+)= w . x[j]. */
static inline __attribute__((always_inline)) void tile(const unsigned char *w, size_t stride, int K,
                                                      const float *x, int xs, float *out, int os, int add,
                                                      const int NB, const int type) {
    __m512 acc[8], odd[8];   /* two chains per input: even and odd 16-column steps */
    #pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[j] = odd[j] = _mm512_setzero_ps();
    const size_t esz = type == T_F32 ? 4 : 2;
    const unsigned char *ahead = w + PF_ROWS * stride;   /* prefetched: the hardware prefetcher stops at 4 KiB pages */
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        if (NB > 1) {
            __builtin_prefetch(ahead + (size_t)k * esz);
            if (type == T_F32) __builtin_prefetch(ahead + (size_t)k * esz + 64);
        }
        const __m512 w0 = wload_full(w, k, type), w1 = wload_full(w, k + 16, type);
        #pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const float *xj = x + (size_t)j * xs + k;
            acc[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xj), acc[j]);
            odd[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xj + 16), odd[j]);
        }
    }
    if (k + 16 <= K) {
        const __m512 wv = wload_full(w, k, type);
        #pragma GCC unroll 8
        for (int j = 0; j < NB; j++) acc[j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (size_t)j * xs + k), acc[j]);
        k += 16;
    }
    if (k < K) {   /* the last K % 16 columns: masked loads, zeros beyond */
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        const __m512 wv = wload(w, k, m, type);
        #pragma GCC unroll 8
        for (int j = 0; j < NB; j++) odd[j] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + (size_t)j * xs + k), odd[j]);
    }
    #pragma GCC unroll 8
    for (int j = 0; j < NB; j++) acc[j] = _mm512_add_ps(acc[j], odd[j]);
    float s[8];
    if (NB == 1) s[0] = hsum16(acc[0]);
    else reduce8(acc, s);   /* unused accumulators are zeros: they do not touch the others' sums */
    #pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        float *o = out + (size_t)j * os;
        *o = add ? *o + s[j] : s[j];
    }
}

/* Rows [r0, r1) against B inputs: per 16-row block (in L1), tiles of up to 8 inputs. */
static inline __attribute__((always_inline)) void tile_rows_typed(const Mat *m, int r0, int r1, const float *x,
                                                                 int xs, int B, float *out, int os, int add,
                                                                 const int type) {
    const size_t stride = (size_t)m->cols * (type == T_F32 ? 4 : 2);
    const unsigned char *base = (const unsigned char *)m->data;
    const int K = m->cols;
    for (int rb = r0; rb < r1; rb += 16) {
        const int re = rb + 16 < r1 ? rb + 16 : r1;
        for (int b = 0; b < B; b += 8) {
            const float *xb = x + (size_t)b * xs;
            float *ob = out + (size_t)b * os - r0;
            for (int r = rb; r < re; r++) {
                const unsigned char *w = base + (size_t)r * stride;
                switch (B - b) {
                case 1: tile(w, stride, K, xb, xs, ob + r, os, add, 1, type); break;
                case 2: tile(w, stride, K, xb, xs, ob + r, os, add, 2, type); break;
                case 3: tile(w, stride, K, xb, xs, ob + r, os, add, 3, type); break;
                case 4: tile(w, stride, K, xb, xs, ob + r, os, add, 4, type); break;
                case 5: tile(w, stride, K, xb, xs, ob + r, os, add, 5, type); break;
                case 6: tile(w, stride, K, xb, xs, ob + r, os, add, 6, type); break;
                case 7: tile(w, stride, K, xb, xs, ob + r, os, add, 7, type); break;
                default: tile(w, stride, K, xb, xs, ob + r, os, add, 8, type); break;
                }
            }
        }
    }
}

static void tile_f32(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add) {
    tile_rows_typed(m, r0, r1, x, xs, B, out, os, add, T_F32);
}
static void tile_f16(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add) {
    tile_rows_typed(m, r0, r1, x, xs, B, out, os, add, T_F16);
}
static void tile_bf16(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add) {
    tile_rows_typed(m, r0, r1, x, xs, B, out, os, add, T_BF16);
}

int tile_rows(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add) {
    switch (m->type) {
    case T_F32: tile_f32(m, r0, r1, x, xs, B, out, os, add); return 1;
    case T_F16: tile_f16(m, r0, r1, x, xs, B, out, os, add); return 1;
    case T_BF16: tile_bf16(m, r0, r1, x, xs, B, out, os, add); return 1;
    default: return 0;
    }
}

#else

int tile_rows(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add) {
    (void)m; (void)r0; (void)r1; (void)x; (void)xs; (void)B; (void)out; (void)os; (void)add;
    return 0;   /* no AVX-512 here: kernels.c's tiles */
}

#endif
