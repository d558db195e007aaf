/* Shared declarations of the native decode step: weight matrices, the plan, the thread pool.
 *
 * Files, one concept each: pool.c (the thread pool that stays steady when a core is taken),
 * kernels.c (row dot products for every weight type, rms_norm, 16-bit conversions),
 * tile.c (float weights times a batch in AVX-512 register tiles),
 * qdot.c (quantized weights: integer dot products against activations rounded to q8 blocks),
 * decode.c (the one-token step of a batch, both attention paths).
 * Layouts are torch's: a Linear weight is (out, in) row-major; activations (B, width).
 */
#ifndef GEN_H
#define GEN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define GEN_X86 1
#endif

#ifdef GEN_X86
/* 16 bytes of nibbles -> 32 u8: low nibbles are weights 0..15, high nibbles 16..31 (the 16 bytes in
 * both halves, the upper shifted by 4) */
static inline __m256i nibbles_u8(const unsigned char *qs) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0f));
}

/* q5_high in a vector: byte j = 16 where bit j of h is set, else 0 (llama.cpp's bytes_from_bits_32:
 * byte j gets h's byte j / 8, every bit but j % 8 set, compared with -1). */
static inline __m256i q5_high8(uint32_t h) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf),
                                          _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
}
#endif

/* Element types of weights and KV caches. Quantized types are llama.cpp's blocks of 32
 * weights along a row: Q8_0 = fp16 d + 32 int8 (w = d*q); Q4_0 = fp16 d + 16 bytes, weight j
 * in the low nibble of byte j and weight j+16 in the high nibble (w = d*(q-8)); Q4_1 = fp16 d,
 * fp16 m + 16 bytes (w = d*q + m). K-quants are super-blocks of 256 weights (QK_K), 8 sub-blocks
 * of 32 (layouts: engine/quant.py): Q4_K = fp16 d, dmin, 12 bytes of packed 6-bit scales and mins,
 * 128 bytes of nibbles (w = d*sc_j * q - dmin*m_j); Q5_K = the same + 32 bytes of 5th bits;
 * Q6_K = 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16), fp16 d
 * (w = d*s * (q - 32)). Q5_0 = fp16 d, 4 bytes qh, 16 bytes of nibbles as Q4_0's (w = d*(q-16),
 * q = nibble | (bit j of qh, a little-endian uint32) << 4); Q5_1 = fp16 d, fp16 m, qh, 16 bytes
 * (w = d*q + m). Every code >= T_Q8_0 is quantized. */
enum { T_F32 = 0, T_F16 = 1, T_BF16 = 2, T_Q8_0 = 3, T_Q4_0 = 4, T_Q4_1 = 5,
       T_Q4_1R = 6, /* q4_1 blocks regrouped per row: every (d, m) pair, then every 16-byte nibble block (qdot.c) */
       T_Q8_0R = 7, /* q8_0 blocks regrouped per row: every d, then every block's 32 int8 weights (qdot.c) */
       T_Q4_K = 8, T_Q5_K = 9, T_Q6_K = 10, T_Q5_0 = 11, T_Q5_1 = 12,
       T_Q5R = 13 /* q5_1 (or q5_0 as m = -16 d) blocks regrouped per row: every (d, m), every qh, every nibble block (qdot.c) */ };
#define QK 32
#define QK_K 256
static inline int is_kquant(int type) { return type >= T_Q4_K && type <= T_Q6_K; }
/* Bytes of one 32-wide block (T_Q8_0 .. T_Q4_1, T_Q5_0, T_Q5_1; the regrouped kinds: their blocks' bytes) */
static inline size_t qk_block_bytes(int type) {
    switch (type) {
    case T_Q8_0: case T_Q8_0R: return 2 + QK;
    case T_Q4_0: return 2 + QK / 2;
    case T_Q5_0: return 2 + 4 + QK / 2;
    case T_Q5_1: case T_Q5R: return 4 + 4 + QK / 2;
    default: return 4 + QK / 2;   /* T_Q4_1, T_Q4_1R */
    }
}
/* A q5 block's qh (bit j: weight j's 5th bit) as 32 bytes, 16 where the bit is set, else 0, in
 * weight order (byte j of the result: weight j), to OR onto the nibbles. */
static inline uint32_t load_u32(const unsigned char *p) { uint32_t h; memcpy(&h, p, 4); return h; }
static inline void q5_high(uint32_t h, unsigned char out[QK]) {
    for (int j = 0; j < QK; j++) out[j] = (unsigned char)(((h >> j) & 1) << 4);
}
static inline size_t kblock_bytes(int type) { return type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210; }
/* Sub-block j (0..7) of a q4_k / q5_k super-block's packed 6-bit scale and min (llama.cpp's
 * get_scale_min_k4): bytes 0-3 scales 0-3, 4-7 mins 0-3, 8-11 the low 4 bits of scales / mins 4-7,
 * whose top 2 bits are the top 2 bits of bytes 0-3 / 4-7. */
static inline void k_scale_min(const unsigned char *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* All 8 at once: byte j of *sc is scale j, of *mn min j (k_scale_min's fields, moved as 32-bit words:
 * the low 6 bits of words 0 and 1 are scales 0-3 and mins 0-3; word 2's nibbles are the low 4 bits
 * of scales 4-7 (low) and mins 4-7 (high), the top 2 bits of words 0 / 1 their top 2 bits). */
static inline void k_scales_mins(const unsigned char *s, uint64_t *sc, uint64_t *mn) {
    uint32_t w[3];
    memcpy(w, s, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    const uint32_t sc_hi = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);
    const uint32_t mn_hi = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);
    *sc = (uint64_t)(w[0] & low6) | (uint64_t)sc_hi << 32;
    *mn = (uint64_t)(w[1] & low6) | (uint64_t)mn_hi << 32;
}

typedef struct Mat {
    const void *data;   /* (rows, cols) in `type`; quantized: rows * cols/32 blocks (K-quants: cols/256) */
    int type, rows, cols;
    /* A stack of row segments of different types (a Q4_K_M file's q, k in Q4_K and v in Q6_K): rest
     * NULL, one type; else rows [0, split) are this Mat's and rows [split, rows) are rest's rows
     * [0, rows - split) (its own data and type, and maybe its own rest). decode.c's matmul splits. */
    int split;
    const struct Mat *rest;
} Mat;

typedef struct {
    int L, C, H, Hkv, D, I, V, B, S_max;   /* S_max: KV slots (softmax; 0 for linear) */
    float eps, scale;                      /* rms_norm eps; 1/sqrt(D) */
    Mat embed, head;
    const void *norm; int norm_type;       /* final norm weight (C) in norm_type */
    const Mat *qkv, *wo, *gu, *wd;         /* L each */
    const void *const *ln1, *const *ln2;   /* L pointers to (C) weights in norm_type */
    void *k, *v; int kv_type;              /* (L, B, Hkv, S_max, D) in kv_type */
    int mode, F;                           /* 0 softmax, else MODE_* feature map; F its width */
    float lin_eps;
    float *S, *z;                          /* (L, B, Hkv, F, D), (L, B, Hkv, F) fp32 */
    float *x, *xb, *qkv_out, *att, *gu_out, *hb;   /* scratch: (B, C) (B, C) (B, (H+2Hkv)D) (B, HD) (B, 2I) (B, I) */
    int nthreads;                          /* threads the step may use, the caller's included */
    float *tscratch;                       /* per thread: tscratch + tid * tscratch_floats (owned by C) */
    size_t tscratch_floats;
    int Bc, seq;                           /* the cache's rows when it holds more than B (0: B); a prompt
                                              plan's sequence (>= 0), a decode plan's -1 (row b is sequence b) */
    /* MODE_HEDGEHOG: learned maps, y = x W + b, phi = [softmax(y), softmax(-y)] (F = 2D), in hh_type:
     * hq_w (L, H, D, D), hq_b (L, H, D) for queries; hk_w (L, Hkv, D, D), hk_b (L, Hkv, D) for keys */
    const void *hq_w, *hq_b, *hk_w, *hk_b;
    int hh_type;
    /* Hybrid layers (NULL: every layer `mode`, state layer l = model layer l): per model layer its mode
     * (MODE_SOFTMAX or `mode`) and its layer inside the KV cache or the linear state. linear_rope:
     * linear layers rotate q and k too (softmax layers always do, when cos is given). */
    const int *layer_mode, *layer_index;
    int linear_rope;
    /* Sliding window + linear (W > 0): every linear layer also attends exactly to the W newest keys,
     * held oldest first in wk, wv (L_lin, B, Hkv, W, D) of w_type; wreal (B, W) bytes, 0 at a pad or
     * empty slot (the caller shifts it after the step, as WindowState.commit). */
    void *wk, *wv;
    const uint8_t *wreal;
    int W, w_type;
    /* MODE_HEDGEHOG with a learned decay (NULL: none): per model layer, key/value head and feature the
     * factor exp(log decay) (L, Hkv, F) fp32 that S and z take before each key (not with W > 0). */
    const float *hh_decay;
    /* ... and a gated decay (NULL: none; then hh_decay is NULL): per token, key/value head and feature
     * g = exp(-sigmoid(hh_logit + rms(v) hh_gate)), rms(v) = v / sqrt(mean(v^2) + 1e-6), from the
     * decay logits hh_logit (L, Hkv, F) and the gate hh_gate (L, Hkv, D, F), fp32. */
    const float *hh_logit, *hh_gate;
    /* Quantized matrices (type >= T_Q8_0): 1 = the activations rounded to q8 blocks once per matmul and
     * integer dots (qdot.c, llama.cpp's arithmetic; regrouped types allowed); 0 = fp32 activations
     * against the blocks decoded in the row dots (kernels.c; T_Q8_0, T_Q4_0, T_Q4_1 only). */
    int q8_acts;
    /* Qwen2: per model layer the q/k/v bias ((H + 2 Hkv) D, fp32), added after the qkv matmul; Qwen3:
     * per model layer the per-head RMSNorm weights of queries and keys (D each, in norm_type), applied
     * to every head before rotary. NULL: none (Llama). */
    const float *const *qkv_bias;
    const void *const *q_norm, *const *k_norm;
    /* Sliding window + a sparse cache of hard keys (R > 0, W 0; engine/attention/sparse.py): per
     * linear layer, cache row and key/value head the recent keys and values rk, rv (L_lin, Bc, Hkv, R,
     * D) right-aligned in w_type, of which the newest sp_held[row] are held (the step appends its own
     * key), and the cached ones ck, cv (L_lin, Bc, Hkv, M, D) in w_type with cuse (L_lin, Bc, Hkv, M)
     * bytes (1: slot in use). Nothing is folded into S, z here: which keys stay cached is decided
     * outside the step, every 64 tokens of a row (SparseWindowState.decide_rows). */
    void *rk, *rv, *ck, *cv;
    const uint8_t *cuse;
    const int *sp_held;
    int R, M;
} Plan;

/* The layout of Mat and Plan as the Python binding checks it (decode.c): struct s (0 Mat, 1 Plan),
 * field i -> its name, byte offset and size; i = -1: the struct's name and sizeof. 0, else -1 (no
 * such field). s = 2: block kind i -> its engine.quant name, type code (as offset) and block bytes
 * (as size). gen_abi_version: moves when a field's meaning changes without its layout. */
int gen_abi(int s, int i, const char **name, size_t *offset, size_t *size);
int gen_abi_version(void);

enum { MODE_SOFTMAX = 0, MODE_ELU1 = 1, MODE_RELU = 2, MODE_SOFTMAX_MAP = 3, MODE_COS1 = 4, MODE_HEDGEHOG = 5 };
#define HEDGEHOG_MAX_D 256

/* ---- kernels.c */
/* out[b*os + r - r0] (+)= row r of m . x[b*xs ...] for r in [r0, r1), b < B */
void mat_rows(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add);
void row_to_f32(const Mat *m, int r, float *dst);
/* ---- tile.c: mat_rows for float weights in AVX-512 register tiles; 0 where it does not apply */
int tile_rows(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add);
/* one row, dequantized */
void rms_norm(float *out, const float *x, const void *w, int wtype, int n, float eps);
float load_f16(uint16_t h);
float load_bf16(uint16_t h);
uint16_t store_f16(float f);
uint16_t store_bf16(float f);
/* n elements of a (type) array from element `at` into fp32 */
void load_row(const void *base, int type, size_t at, int n, float *dst);
void store_row(void *base, int type, size_t at, int n, const float *src);

/* ---- qdot.c: quantized weights (type >= T_Q8_0) times activations rounded to q8 blocks */
size_t qx_row_bytes(int K);                                   /* one row of K inputs as q8 blocks */
/* B rows, qx_row_bytes(K) apart; for T_Q4_1R and T_Q5R matrices (`type`) the q bytes of every full group of 4
 * blocks are stored low halves first (qdot.c) */
void quantize_x(const float *x, int xs, int B, int K, void *qx, int type);
void qmat_rows(const Mat *m, int r0, int r1, const void *qx, int B, float *out, int os, int add);

/* ---- pool.c */
/* A job: `fn` computes units [u0, u1) for every row b, writing out[b*os + (u - u0)*width + j]
 * (add: +=). `ctx` is copied into the job (a late worker never reads the caller's stack). */
typedef void (*UnitsFn)(const void *ctx, int u0, int u1, float *out, int os, int add, float *scratch);
#define JOB_CTX_BYTES 256
/* Runs `fn` over `units` in chunks of `chunk_units` on up to `nthreads` threads (the caller's
 * included). Thread t's scratch is scratch + t * stride: `fn_scratch` floats for fn, then a
 * private output buffer of B * chunk_units * width floats (workers compute there and publish). */
void pool_run(int nthreads, UnitsFn fn, const void *ctx, size_t ctx_bytes, int units, int width,
              int chunk_units, int B, float *out, int os, int add,
              float *scratch, size_t stride, size_t fn_scratch);
void pool_quiesce(void);   /* returns once no worker is inside a chunk (before freeing a plan) */

/* ---- small vector helpers (inline: called per key in attention) */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v8 v) {
#ifdef GEN_X86
    __m256 x = (__m256)v;
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
#else
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
#endif
}

static inline float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    v8 acc = {0};
    for (; i + 8 <= n; i += 8) acc += ld8(a + i) * ld8(b + i);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEN_AVX512 1
/* 8 accumulators -> their 8 lane sums in s.
 * Every sum takes the same tree: lanes (j, j+8), then (j, j+4), (j, j+2), (j, j+1); hsum16 is the
 * same tree for one accumulator, so a row's sum does not depend on how many inputs share its tile. */
static inline __attribute__((always_inline)) void reduce8(const __m512 a[8], float *s) {
    __m512 h[4], t[2];
    for (int p = 0; p < 4; p++)   /* per accumulator of the pair: quarters q0+q2, q1+q3 (lanes j, j+8) */
        h[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
    for (int p = 0; p < 2; p++)   /* one accumulator per quarter, 4 partials each (lanes j, j+4) */
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * p], h[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(h[2 * p], h[2 * p + 1], 0xdd));
    /* quarter q of t[p] is accumulator 4p + q: (p0 + p2, p1 + p3), then their sum */
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x44), _mm512_shuffle_ps(t[0], t[1], 0xee));
    __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e, e, 0x88), _mm512_shuffle_ps(e, e, 0xdd));
    /* quarter q of f: [acc q, acc 4+q, acc q, acc 4+q] */
    float o[16] __attribute__((aligned(64)));
    _mm512_store_ps(o, f);
    for (int q = 0; q < 4; q++) { s[q] = o[4 * q]; s[4 + q] = o[4 * q + 1]; }
}

static inline float hsum16(__m512 a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));   /* j, j+8 */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));       /* j, j+4 */
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                              /* j, j+2 */
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));                             /* j, j+1 */
}

#endif

#if defined(__AVX512F__) || (defined(GEN_X86) && defined(__FMA__))
/* e^r's Taylor coefficients, highest power first (exp8d and exp4d: the same series) */
static const double EXP_SERIES[13] = {1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                                      1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0};
#endif

#if defined(__AVX512F__)
/* e^x of 8 doubles, |x| <= 110: n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, n ln2_hi
 * exact), e^r by its Taylor series to r^12 (|r| <= 0.347: relative error < 1e-14), times 2^n. */
static inline __m512d exp8d(__m512d x) {
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
    __m512d p = _mm512_set1_pd(EXP_SERIES[0]);
    for (int i = 1; i < 13; i++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(EXP_SERIES[i]));
    return _mm512_scalef_pd(p, n);
}

/* e^x in 16 float lanes, computed in double and rounded once: the correctly rounded expf but for
 * ~1 value in 10^4 (glibc's expf and PyTorch's vectorised exp are, too, so the forms agree: a
 * quantized matmul rounds its inputs to q8 and would turn a last-bit difference into a step).
 * x is clamped to [-110, 88.7]: below, exactly 0 (a -inf score, a masked pad, weighs 0). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-110.0f));
    __m256 lo = _mm512_cvtpd_ps(exp8d(_mm512_cvtps_pd(_mm512_castps512_ps256(x))));
    __m256 hi = _mm512_cvtpd_ps(exp8d(_mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
#endif

#if defined(GEN_X86) && defined(__FMA__) && !defined(__AVX512F__)
#define GEN_EXP8 1
/* exp8d's AVX2 twin for CPUs without AVX-512: the same reduction and series in 4 double lanes, and
 * 2^n (|n| <= 160) put together from its exponent bits instead of scalef: the same products, so the
 * same values as exp16. */
static inline __m256d exp4d(__m256d x) {
    __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93147180369123816490e-01), x);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.90821492927058770002e-10), r);
    __m256d p = _mm256_set1_pd(EXP_SERIES[0]);
    for (int i = 1; i < 13; i++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(EXP_SERIES[i]));
    __m256i e = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)),
                                                   _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}

/* e^x in 8 float lanes, as exp16 (computed in double, rounded once; x clamped to [-110, 88.7]). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-110.0f));
    __m128 lo = _mm256_cvtpd_ps(exp4d(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
    __m128 hi = _mm256_cvtpd_ps(exp4d(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
    return _mm256_set_m128(hi, lo);
}
#endif

static inline void axpy_f32(float *restrict y, float a, const float *restrict x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}


/* ---- shared by decode.c (the step), attention.c (softmax attention), linear.c (linear attention) */
#define CHUNKS_PER_THREAD 4     /* chunks a phase is cut into, per thread (dynamic claiming) */
extern long long gen_par_min_macs;   /* a phase below this many multiply-adds runs on the caller alone */

/* A decode plan's row b is sequence b at `slot` (of a cache holding Bc >= B sequences when Bc > 0:
 * the first B of a cache with spare rows, seq -1); a prompt plan's (Bc > 0, seq >= 0) row r is token r
 * of a block of sequence `seq` (of a cache holding Bc sequences), at slot + r. */
static inline int prompt_plan(const Plan *p) { return p->Bc > 0 && p->seq >= 0; }
static inline int cache_batch(const Plan *p) { return p->Bc > 0 ? p->Bc : p->B; }
static inline int cache_seq(const Plan *p, int r) { return prompt_plan(p) ? p->seq : r; }
static inline int row_slot(const Plan *p, int slot, int r) { return prompt_plan(p) ? slot + r : slot; }
/* ------------------------------------------------------------------ per-thread scratch */
#define KCH 32   /* 16-bit cache rows widened to fp32 this many at a time */

/* Per-thread scratch of the units functions: scores (G * S_max: a KV group's G heads), row (D),
 * acc (G * D), tmp (D), a block of KCH widened cache rows (KCH * D), then phi_k and phi_q (F + 1
 * each), window scores (W + 1) and two window rows (D each), then a gated decay's factors (F + 1). */
static inline size_t att_scratch(const Plan *p) {
    const size_t G = (size_t)(p->H / p->Hkv);
    return G * p->S_max + (2 + G + KCH) * (size_t)p->D;
}

/* A prompt plan with fp32 activations on quantized weights (q8_acts 0) widens DQ_ROWS rows of
 * a matrix at a time into the thread's scratch and runs the float row kernels on them (decode.c). */
#define DQ_ROWS 16
static inline size_t dq_scratch(const Plan *p) {
    if (p->q8_acts || !prompt_plan(p)) return 0;
    size_t w = (size_t)p->C;
    if ((size_t)p->H * p->D > w) w = (size_t)p->H * p->D;
    if ((size_t)p->I > w) w = (size_t)p->I;
    return DQ_ROWS * w;
}

static inline size_t fn_scratch(const Plan *p) {
    size_t att = att_scratch(p) + 3 * (size_t)(p->F + 1) + (size_t)p->W + (size_t)p->R + (size_t)p->M + 1
                 + 2 * (size_t)p->D + 16, dq = dq_scratch(p);
    return att > dq ? att : dq;
}

void softmax_attention(const Plan *p, int l, int slot, const uint8_t *slot_real);   /* attention.c */
void linear_attention(const Plan *p, int l, int ml);                                 /* linear.c */
void window_attention(const Plan *p, int l, int ml);                                 /* linear.c */
void sparse_attention(const Plan *p, int l, int ml);                                 /* linear.c */

#endif
