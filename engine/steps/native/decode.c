/* One decode step of a Llama-shaped model for a batch of B sequences: softmax attention over a
 * KV cache, or linear attention as an RNN over (S, z). The native twin of
 * engine/steps/torch_step.py:decode_one.
 *
 * It reads the model's own weight tensors (fp32, f16, bf16 or quantized blocks, see gen.h) and
 * writes the state's own tensors in place: the Python side passes their data pointers in a Plan.
 * Layouts: cache (L, B, Hkv, S_max, D) in kv_type; linear S (L, B, Hkv, F, D) and z (L, B, Hkv,
 * F) fp32; rotary rows (B, D) cos and sin in the half-split layout (row stride 0: shared).
 * Every row of the batch writes cache slot `slot`; after a left-padded prefill a row's rotary
 * position is its own length (the caller passes its row) and `slot_real` (B, S_max) masks the pad
 * slots out of the softmax. Pads never entered the linear state, so it needs no mask.
 *
 * Matrices run on the thread pool (pool.c) by rows, softmax attention by KV groups; a phase too
 * small to pay for the hand-off runs on the caller alone. Compute is fp32 throughout.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"

/* A phase below this many multiply-adds runs on the caller alone (tests set 0: every phase on the pool). */
static long long par_min_macs = 24576;
void gen_set_parallel_min(long long macs) { par_min_macs = macs; }
#define CHUNKS_PER_THREAD 4     /* chunks a phase is cut into, per thread (dynamic claiming) */

/* ------------------------------------------------------------------ per-thread scratch */
#define KCH 32   /* 16-bit cache rows widened to fp32 this many at a time */

/* Per-thread scratch of the units functions: scores (G * S_max: a KV group's G heads), row (D),
 * acc (G * D), tmp (D), a block of KCH widened cache rows (KCH * D), then phi_k and phi_q (F + 1
 * each), window scores (W + 1) and two window rows (D each). */
static size_t att_scratch(const Plan *p) {
    const size_t G = (size_t)(p->H / p->Hkv);
    return G * p->S_max + (2 + G + KCH) * (size_t)p->D;
}

static size_t fn_scratch(const Plan *p) {
    return att_scratch(p) + 2 * (size_t)(p->F + 1) + (size_t)p->W + 1 + 2 * (size_t)p->D + 16;
}

static int widest(const Plan *p) {
    int w = p->C, cand[] = {(p->H + 2 * p->Hkv) * p->D, 2 * p->I, p->V, p->H * p->D};
    for (int i = 0; i < 4; i++) if (cand[i] > w) w = cand[i];
    return w;
}

int gen_plan_init(Plan *p) {
    if (p->nthreads < 1) p->nthreads = 1;
    p->tscratch_floats = (fn_scratch(p) + (size_t)p->B * widest(p) + 15) & ~(size_t)15;
    /* after every thread's scratch: the activations of a quantized matmul as q8 blocks (qdot.c) */
    size_t qx_floats = ((size_t)p->B * qx_row_bytes(widest(p)) / sizeof(float) + 15) & ~(size_t)15;
    p->tscratch = aligned_alloc(64, (p->tscratch_floats * p->nthreads + qx_floats) * sizeof(float));
    return p->tscratch ? 0 : -1;
}

void gen_plan_free(Plan *p) {
    pool_quiesce();     /* no worker is still reading this plan's weights or scratch */
    free(p->tscratch);
    p->tscratch = NULL;
}

/* ------------------------------------------------------------------ matrices on the pool */
typedef struct { Mat m; const float *x; int xs, B; const void *qx; } MatCtx;

static void mat_fn(const void *ctx, int r0, int r1, float *out, int os, int add, float *scratch) {
    const MatCtx *c = ctx;
    (void)scratch;
    if (c->qx) qmat_rows(&c->m, r0, r1, c->qx, c->B, out, os, add);
    else mat_rows(&c->m, r0, r1, c->x, c->xs, c->B, out, os, add);
}

/* out (B, os) (+)= x (B, xs) @ m^T */
static void matmul(const Plan *p, const Mat *m, const float *x, int xs, float *out, int os, int add) {
    long long macs = (long long)m->rows * m->cols * p->B;
    const void *qx = NULL;
    if (m->type >= T_Q8_0) {   /* quantized weights: x rounded to q8 blocks once, integer dots (qdot.c) */
        void *buf = p->tscratch + p->tscratch_floats * p->nthreads;
        quantize_x(x, xs, p->B, m->cols, buf);
        qx = buf;
    }
    if (p->nthreads <= 1 || macs < par_min_macs) {
        if (qx) qmat_rows(m, 0, m->rows, qx, p->B, out, os, add);
        else mat_rows(m, 0, m->rows, x, xs, p->B, out, os, add);
        return;
    }
    int chunks = p->nthreads * CHUNKS_PER_THREAD, rows = (m->rows + chunks - 1) / chunks;
    rows = (rows + 7) & ~7;
    if ((m->rows + rows - 1) / rows > 64) rows = (m->rows + 63) / 64;
    MatCtx c = {*m, x, xs, p->B, qx};
    pool_run(p->nthreads, mat_fn, &c, sizeof c, m->rows, 1, rows, p->B, out, os, add,
             p->tscratch, p->tscratch_floats, fn_scratch(p));
}

/* ------------------------------------------------------------------ softmax attention */
typedef struct { const Plan *p; int l, slot; const uint8_t *slot_real; } AttCtx;

/* A decode plan's row b is sequence b at `slot`; a prefill plan's (Bc > 0) row r is token r of a
 * block of sequence `seq` (of a cache holding Bc sequences), at slot + r. */
static inline int cache_batch(const Plan *p) { return p->Bc > 0 ? p->Bc : p->B; }
static inline int cache_seq(const Plan *p, int r) { return p->Bc > 0 ? p->seq : r; }
static inline int row_slot(const Plan *p, int slot, int r) { return p->Bc > 0 ? slot + r : slot; }

/* 4 dot products q . k_j for the rows k, k + D, k + 2D, k + 3D (D a multiple of 8): independent
 * accumulators, so the adds of one key do not wait for the previous key's. */
static inline void dot4(const float *q, const float *k, int D, float *out) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int i = 0; i < D; i += 8) {
        v8 qv = ld8(q + i);
        a0 += qv * ld8(k + i);
        a1 += qv * ld8(k + D + i);
        a2 += qv * ld8(k + 2 * D + i);
        a3 += qv * ld8(k + 3 * D + i);
    }
    out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);
}

/* 8 dot products q . k_j for the rows k + j*D, j < 8 (D a multiple of 8): lane-wise accumulators,
 * then one transposing reduction for all 8 (hadd tree) instead of 8 horizontal sums. */
static inline void dot8(const float *q, const float *k, int D, float *out) {
    v8 a[8] = {{0}};
    for (int i = 0; i < D; i += 8) {
        v8 qv = ld8(q + i);
        for (int j = 0; j < 8; j++) a[j] += qv * ld8(k + (size_t)j * D + i);
    }
#ifdef GEN_X86
    __m256 h01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), h23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 h45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), h67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);   /* [s0..s3 | s0..s3] halves */
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
#else
    for (int j = 0; j < 8; j++)
        out[j] = ((a[j][0] + a[j][1]) + (a[j][2] + a[j][3])) + ((a[j][4] + a[j][5]) + (a[j][6] + a[j][7]));
#endif
}

/* out (D) = sum_t w[t] v_t over the rows of an fp32 (n, D) block, D a multiple of 8. Keys outer,
 * 32 lanes of a row at a time in 8 accumulators (even keys, odd keys: the same order of adds as
 * 8 lanes at a time), so the rows stream through once and no add waits on the one before. */
static inline void weighted_rows(const float *w, const float *v, int n, int D, float *out) {
    int i = 0;
    for (; i + 32 <= D; i += 32) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        const float *r = v + i;
        int t = 0;
        for (; t + 2 <= n; t += 2, r += 2 * (size_t)D) {
            float w0 = w[t], w1 = w[t + 1];
            a0 += w0 * ld8(r); a1 += w0 * ld8(r + 8); a2 += w0 * ld8(r + 16); a3 += w0 * ld8(r + 24);
            b0 += w1 * ld8(r + D); b1 += w1 * ld8(r + D + 8); b2 += w1 * ld8(r + D + 16); b3 += w1 * ld8(r + D + 24);
        }
        if (t < n) { float w0 = w[t]; a0 += w0 * ld8(r); a1 += w0 * ld8(r + 8); a2 += w0 * ld8(r + 16); a3 += w0 * ld8(r + 24); }
        v8 o0 = a0 + b0, o1 = a1 + b1, o2 = a2 + b2, o3 = a3 + b3;
        memcpy(out + i, &o0, sizeof o0); memcpy(out + i + 8, &o1, sizeof o1);
        memcpy(out + i + 16, &o2, sizeof o2); memcpy(out + i + 24, &o3, sizeof o3);
    }
    for (; i < D; i += 8) {
        v8 a0 = {0}, a1 = {0};
        int t = 0;
        for (; t + 2 <= n; t += 2) {
            a0 += w[t] * ld8(v + (size_t)t * D + i);
            a1 += w[t + 1] * ld8(v + (size_t)(t + 1) * D + i);
        }
        if (t < n) a0 += w[t] * ld8(v + (size_t)t * D + i);
        v8 r = a0 + a1;
        memcpy(out + i, &r, sizeof r);
    }
}

/* sc (n) <- softmax(scale * sc) in place; slots t with real[t] == 0 (pads; never `slot`, the
 * row's own) weigh exactly 0. Scale, max, exp and the division in 16 lanes (each element as the
 * scalar form computes it); the sum in order: a reassociated sum moves the weights' last bits, and
 * a quantized o_proj rounds its inputs to q8, which turns a last bit into a step (the q8 twin's
 * logits moved by 7e-2 with a 16-lane sum). */
static void softmax_scores(float *sc, int n, float scale, const uint8_t *real, int slot) {
    if (real)
        for (int t = 0; t < n; t++)
            if (!real[t] && t != slot) sc[t] = -INFINITY;
    int t = 0;
    float mx = -INFINITY, sum = 0.0f;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(scale);
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc + t), s);
        _mm512_storeu_ps(sc + t, v);
        m = _mm512_max_ps(m, v);
    }
    mx = _mm512_reduce_max_ps(m);
    for (int u = t; u < n; u++) { sc[u] *= scale; if (sc[u] > mx) mx = sc[u]; }
    const __m512 vmx = _mm512_set1_ps(mx);
    for (t = 0; t < n; t += 16) {
        __mmask16 k = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        _mm512_mask_storeu_ps(sc + t, k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), vmx)));
    }
    for (t = 0; t < n; t++) sum += sc[t];   /* in order, as the scalar form and PyTorch's short rows */
    const __m512 vs = _mm512_set1_ps(sum);
    for (t = 0; t + 16 <= n; t += 16) _mm512_storeu_ps(sc + t, _mm512_div_ps(_mm512_loadu_ps(sc + t), vs));
    for (; t < n; t++) sc[t] /= sum;
#else
    for (; t < n; t++) { sc[t] *= scale; if (sc[t] > mx) mx = sc[t]; }
    for (t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    for (t = 0; t < n; t++) sc[t] /= sum;
#endif
}

/* hb (I) = silu(gate) * up for gu = [gate (I), up (I)] */
static void silu_mul(const float *gu, float *hb, int I) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= I; i += 16) {
        __m512 g = _mm512_loadu_ps(gu + i), e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(hb + i, _mm512_mul_ps(sg, _mm512_loadu_ps(gu + I + i)));
    }
#endif
    for (; i < I; i++) hb[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[I + i];
}

#ifdef GEN_AVX512
/* A 16-bit cache read in place (no widened copy): 16 values from h as fp32. */
static inline __m512 ld16h(const uint16_t *h, const int type) {
    __m256i v = _mm256_loadu_si256((const __m256i *)h);
    if (type == T_F16) return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* out[i] = q . k_i for the 16-bit rows k + i*D, i < m (m <= 8; D a multiple of 16): the last
 * keys of a row, fewer than 8. */
static inline void dots16(const float *q, const uint16_t *k, int D, int m, const int type, float *out) {
    __m512 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int i = 0; i < m; i++) a[i] = _mm512_fmadd_ps(qv, ld16h(k + (size_t)i * D + d, type), a[i]);
    }
    float s[8];
    reduce8(a, s);
    memcpy(out, s, (size_t)m * sizeof(float));
}

/* out (D) = sum_t w[t] v_t over n 16-bit rows v (D a multiple of 16): 64 columns at a time, even
 * and odd keys in separate accumulators. */
static inline void weighted16(const float *w, const uint16_t *v, int n, int D, const int type, float *out) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nb = D - d0 < 64 ? (D - d0) / 16 : 4;
        __m512 a[4], b[4];
        for (int i = 0; i < 4; i++) a[i] = b[i] = _mm512_setzero_ps();
        int t = 0;
        for (; t + 2 <= n; t += 2) {
            const __m512 w0 = _mm512_set1_ps(w[t]), w1 = _mm512_set1_ps(w[t + 1]);
            const uint16_t *r = v + (size_t)t * D + d0;
            for (int i = 0; i < nb; i++) {
                a[i] = _mm512_fmadd_ps(w0, ld16h(r + 16 * i, type), a[i]);
                b[i] = _mm512_fmadd_ps(w1, ld16h(r + D + 16 * i, type), b[i]);
            }
        }
        if (t < n)
            for (int i = 0; i < nb; i++)
                a[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[t]), ld16h(v + (size_t)t * D + d0 + 16 * i, type), a[i]);
        for (int i = 0; i < nb; i++) _mm512_storeu_ps(out + d0 + 16 * i, _mm512_add_ps(a[i], b[i]));
    }
}

static inline v8 ldh8(const uint16_t *h, const int type) {
    __m128i v = _mm_loadu_si128((const __m128i *)h);
    if (type == T_F16) return (v8)_mm256_cvtph_ps(v);
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* dot8 on 16-bit rows, widened in registers (D a multiple of 8). */
static inline void dot8h(const float *q, const uint16_t *k, int D, const int type, float *out) {
    v8 a[8] = {{0}};
    for (int i = 0; i < D; i += 8) {
        v8 qv = ld8(q + i);
        for (int j = 0; j < 8; j++) a[j] += qv * ldh8(k + (size_t)j * D + i, type);
    }
    __m256 h01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), h23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 h45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), h67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
}

/* One KV group's attention on a 16-bit cache, read in place: K, V (n, D) rows; q and o G heads
 * of D; sc G rows of S_max scores. */
static void group16(const Plan *p, const float *q, const uint16_t *K, const uint16_t *V, int n, int G,
                    float *sc, const uint8_t *real, int slot, float *o) {
    const int D = p->D, type = p->kv_type;
    for (int t = 0; t < n; t += 8) {
        const int m = n - t < 8 ? n - t : 8;
        for (int i = 0; i < m * D; i += 32) __builtin_prefetch(V + (size_t)t * D + i);   /* values beside keys */
        for (int j = 0; j < G; j++)
            if (m == 8) {   /* 8 lanes at a time and one hadd tree: 1.35x the 16-lane form's speed */
                if (type == T_F16) dot8h(q + j * D, K + (size_t)t * D, D, T_F16, sc + (size_t)j * p->S_max + t);
                else dot8h(q + j * D, K + (size_t)t * D, D, T_BF16, sc + (size_t)j * p->S_max + t);
            }
            else if (type == T_F16) dots16(q + j * D, K + (size_t)t * D, D, m, T_F16, sc + (size_t)j * p->S_max + t);
            else dots16(q + j * D, K + (size_t)t * D, D, m, T_BF16, sc + (size_t)j * p->S_max + t);
    }
    for (int j = 0; j < G; j++) {
        softmax_scores(sc + (size_t)j * p->S_max, n, p->scale, real, slot);
        if (type == T_F16) weighted16(sc + (size_t)j * p->S_max, V, n, D, T_F16, o + j * D);
        else weighted16(sc + (size_t)j * p->S_max, V, n, D, T_BF16, o + j * D);
    }
}
#endif

/* KV groups [g0, g1) of every row: out[b*os + ((g - g0)*G + j)*D + d] for the group's G query
 * heads j. Each key and value row is read once per group (from memory; the group's other heads
 * take it from L1): GQA reads the cache once, not once per query head. */
static void att_fn(const void *ctx, int g0, int g1, float *out, int os, int add, float *scratch) {
    const AttCtx *c = ctx;
    const Plan *p = c->p;
    const int D = p->D, G = p->H / p->Hkv, QKV = (p->H + 2 * p->Hkv) * D, Bc = cache_batch(p);
    const int fast = p->kv_type == T_F32 && D % 8 == 0;
    float *sc = scratch, *row = sc + (size_t)G * p->S_max, *acc = row + D, *tmp = acc + (size_t)G * D, *blk = tmp + D;
    const int widen = p->kv_type != T_F32 && D % 8 == 0;   /* 16-bit cache: KCH rows at a time */
    (void)add;
    for (int b = 0; b < p->B; b++) {
        const int cb = cache_seq(p, b), slot = row_slot(p, c->slot, b), n = slot + 1;
        const uint8_t *real = c->slot_real ? c->slot_real + (size_t)cb * p->S_max : NULL;
        for (int g = g0; g < g1; g++) {
            const float *q = p->qkv_out + (size_t)b * QKV + (size_t)g * G * D;   /* head j: q + j*D */
            const size_t base = (((size_t)c->l * Bc + cb) * p->Hkv + g) * p->S_max * D;
            const float *K = (const float *)p->k + base, *V = (const float *)p->v + base;
            float *o = out + (size_t)b * os + (size_t)(g - g0) * G * D;   /* head j: o + j*D */
#ifdef GEN_AVX512
            if (p->kv_type != T_F32 && D % 16 == 0) {
                group16(p, q, (const uint16_t *)p->k + base, (const uint16_t *)p->v + base, n, G, sc, real, slot, o);
                continue;
            }
#endif
            int t = 0;
            if (fast) {
                for (; t + 8 <= n; t += 8) {
                    /* the same keys' values, next: their stream runs beside the keys' (measured on tiny,
                     * B = 8 at depth 178 out of DRAM: attention 1.53-1.64 -> 1.37-1.45 ms) */
                    for (int i = 0; i < 8 * D; i += 16) __builtin_prefetch(V + (size_t)t * D + i);
                    for (int j = 0; j < G; j++) dot8(q + j * D, K + (size_t)t * D, D, sc + (size_t)j * p->S_max + t);
                }
                for (; t + 4 <= n; t += 4)
                    for (int j = 0; j < G; j++) dot4(q + j * D, K + (size_t)t * D, D, sc + (size_t)j * p->S_max + t);
            }
            if (widen)
                for (; t < n; t += KCH) {
                    int m = n - t < KCH ? n - t : KCH;
                    load_row(p->k, p->kv_type, base + (size_t)t * D, m * D, blk);
                    for (int j = 0; j < G; j++) {
                        float *sj = sc + (size_t)j * p->S_max + t;
                        int i = 0;
                        for (; i + 8 <= m; i += 8) dot8(q + j * D, blk + (size_t)i * D, D, sj + i);
                        for (; i + 4 <= m; i += 4) dot4(q + j * D, blk + (size_t)i * D, D, sj + i);
                        for (; i < m; i++) sj[i] = dot_f32(q + j * D, blk + (size_t)i * D, D);
                    }
                }
            for (; t < n; t++) {
                const float *key = row;
                if (p->kv_type == T_F32) key = K + (size_t)t * D;
                else load_row(p->k, p->kv_type, base + (size_t)t * D, D, row);
                for (int j = 0; j < G; j++) sc[(size_t)j * p->S_max + t] = dot_f32(q + j * D, key, D);
            }
            for (int j = 0; j < G; j++) softmax_scores(sc + (size_t)j * p->S_max, n, p->scale, real, slot);
            if (fast && G == 1) {
                weighted_rows(sc, V, n, D, o);
                continue;
            }
            memset(acc, 0, (size_t)G * D * sizeof(float));
            if (fast || widen) {   /* KCH value rows at a time, used by every head of the group */
                for (t = 0; t < n; t += KCH) {
                    int m = n - t < KCH ? n - t : KCH;
                    const float *vb = V + (size_t)t * D;
                    if (widen) { load_row(p->v, p->kv_type, base + (size_t)t * D, m * D, blk); vb = blk; }
                    for (int j = 0; j < G; j++) {
                        weighted_rows(sc + (size_t)j * p->S_max + t, vb, m, D, tmp);
                        for (int d = 0; d < D; d++) acc[j * D + d] += tmp[d];
                    }
                }
            } else {
                for (t = 0; t < n; t++) {
                    load_row(p->v, p->kv_type, base + (size_t)t * D, D, row);
                    for (int j = 0; j < G; j++)
                        if (sc[(size_t)j * p->S_max + t] != 0.0f) axpy_f32(acc + j * D, sc[(size_t)j * p->S_max + t], row, D);
                }
            }
            memcpy(o, acc, (size_t)G * D * sizeof(float));
        }
    }
}

static void softmax_attention(const Plan *p, int l, int slot, const uint8_t *slot_real) {
    const int D = p->D, QKV = (p->H + 2 * p->Hkv) * D;
    for (int b = 0; b < p->B; b++)
        for (int g = 0; g < p->Hkv; g++) {
            size_t at = ((((size_t)l * cache_batch(p) + cache_seq(p, b)) * p->Hkv + g) * p->S_max + row_slot(p, slot, b)) * D;
            const float *k = p->qkv_out + (size_t)b * QKV + (p->H + g) * D, *v = k + p->Hkv * D;
            store_row(p->k, p->kv_type, at, D, k);
            store_row(p->v, p->kv_type, at, D, v);
        }
    AttCtx c = {p, l, slot, slot_real};
    long long macs = 2LL * p->B * p->H * (row_slot(p, slot, p->B - 1) + 1) * D;
    if (p->nthreads <= 1 || macs < par_min_macs) {
        att_fn(&c, 0, p->Hkv, p->att, p->H * D, 0, p->tscratch);
        return;
    }
    /* units: KV groups, each G heads wide (a group's heads are adjacent columns of att) */
    int per = (p->Hkv + p->nthreads * CHUNKS_PER_THREAD - 1) / (p->nthreads * CHUNKS_PER_THREAD);
    pool_run(p->nthreads, att_fn, &c, sizeof c, p->Hkv, (p->H / p->Hkv) * D, per, p->B, p->att, p->H * D, 0,
             p->tscratch, p->tscratch_floats, fn_scratch(p));
}

/* ------------------------------------------------------------------ linear attention */
/* phi(x): x (D) -> out (F); as engine/attention/feature_maps.py */
static void feature_map(int mode, const float *x, float *out, int D) {
    if (mode == MODE_ELU1) {
        for (int i = 0; i < D; i++) out[i] = x[i] > 0.0f ? x[i] + 1.0f : expf(x[i] < -60.0f ? -60.0f : x[i]);
    } else if (mode == MODE_RELU) {
        for (int i = 0; i < D; i++) out[i] = x[i] > 0.0f ? x[i] : 0.0f;
    } else if (mode == MODE_SOFTMAX_MAP) {
        float mx = x[0], sum = 0.0f;
        for (int i = 1; i < D; i++) if (x[i] > mx) mx = x[i];
        for (int i = 0; i < D; i++) { out[i] = expf(x[i] - mx); sum += out[i]; }
        for (int i = 0; i < D; i++) out[i] /= sum;
    } else {  /* MODE_COS1: x / max(|x|, 1e-12), then a constant 1 */
        float ss = 0.0f;
        for (int i = 0; i < D; i++) ss += x[i] * x[i];
        float n = sqrtf(ss);
        if (n < 1e-12f) n = 1e-12f;
        for (int i = 0; i < D; i++) out[i] = x[i] / n;
        out[D] = 1.0f;
    }
}

/* The learned map of layer l, query head `head` (is_q) or key/value head `head`: y = x W + b,
 * out = [softmax(y), softmax(-y)] (2D); as engine.attention.feature_maps.hedgehog_phi. */
static void hedgehog_map(const Plan *p, int l, int head, int is_q, const float *x, float *out) {
    const int D = p->D;
    const size_t at = (size_t)l * (is_q ? p->H : p->Hkv) + head;
    const void *W = is_q ? p->hq_w : p->hk_w;
    float y[HEDGEHOG_MAX_D], w[HEDGEHOG_MAX_D], bias[HEDGEHOG_MAX_D];
    for (int j = 0; j < D; j++) y[j] = 0.0f;
    for (int i = 0; i < D; i++) {
        load_row(W, p->hh_type, (at * D + i) * D, D, w);
        const float xi = x[i];
        #pragma omp simd
        for (int j = 0; j < D; j++) y[j] += xi * w[j];
    }
    load_row(is_q ? p->hq_b : p->hk_b, p->hh_type, at * D, D, bias);
    float mx = -INFINITY, mn = INFINITY, sp = 0.0f, sn = 0.0f;
    for (int j = 0; j < D; j++) {
        y[j] += bias[j];
        if (y[j] > mx) mx = y[j];
        if (y[j] < mn) mn = y[j];
    }
    for (int j = 0; j < D; j++) {
        out[j] = expf(y[j] - mx);
        out[D + j] = expf(mn - y[j]);
        sp += out[j];
        sn += out[D + j];
    }
    for (int j = 0; j < D; j++) { out[j] /= sp; out[D + j] /= sn; }
}

static void phi(const Plan *p, int l, int head, int is_q, const float *x, float *out) {
    if (p->mode == MODE_HEDGEHOG) hedgehog_map(p, l, head, is_q, x, out);
    else feature_map(p->mode, x, out, p->D);
}

/* S += phi_k v^T, z += phi_k: one key into a group's linear state (S (F, D), z (F)). */
static inline void fold_key(float *S, float *z, const float *phi_k, const float *v, int F, int D) {
    for (int f = 0; f < F; f++) {
        float a = phi_k[f];
        #pragma omp simd
        for (int d = 0; d < D; d++) S[f * D + d] += a * v[d];
        z[f] += a;
    }
}

/* out (D) = phi_q^T S; returns phi_q . z (the linear part of the denominator). */
static inline float read_state(const float *S, const float *z, const float *phi_q, int F, int D, float *out) {
    float den = 0.0f;
    for (int d = 0; d < D; d++) out[d] = 0.0f;
    for (int f = 0; f < F; f++) {
        float a = phi_q[f];
        den += a * z[f];
        #pragma omp simd
        for (int d = 0; d < D; d++) out[d] += a * S[f * D + d];
    }
    return den;
}

/* One token per row: S += phi(k) v^T, z += phi(k); out_h = phi(q_h)^T S / (phi(q_h)^T z + eps).
 * l: the layer inside the linear state; ml: the model layer (learned maps are per model layer). */
static void linear_attention(const Plan *p, int l, int ml) {
    const int D = p->D, F = p->F, G = p->H / p->Hkv, QKV = (p->H + 2 * p->Hkv) * D;
    float *phi_k = p->tscratch + att_scratch(p), *phi_q = phi_k + F + 1;
    for (int b = 0; b < p->B; b++) {
        const float *q = p->qkv_out + (size_t)b * QKV, *k = q + p->H * D, *v = k + p->Hkv * D;
        for (int g = 0; g < p->Hkv; g++) {
            size_t sg = ((size_t)l * cache_batch(p) + cache_seq(p, b)) * p->Hkv + g;
            float *S = p->S + sg * F * D, *z = p->z + sg * F;
            const float *vg = v + g * D;
            phi(p, ml, g, 0, k + g * D, phi_k);
            fold_key(S, z, phi_k, vg, F, D);
            for (int j = 0; j < G; j++) {
                int h = g * G + j;
                phi(p, ml, h, 1, q + h * D, phi_q);
                float *out = p->att + (size_t)b * p->H * D + h * D;
                float den = read_state(S, z, phi_q, F, D, out) + p->lin_eps;
                for (int d = 0; d < D; d++) out[d] /= den;
            }
        }
    }
}

/* Sliding window + linear, one token per row (engine/attention/window.py with T = 1): the oldest
 * buffered key leaves the window into S, z; the query attends exactly to the other W - 1 buffered
 * keys and its own, and through phi to S, z, in one normalisation:
 *   out = (sum_j a_j v_j + phi(q)^T S) / (sum_j a_j + phi(q)^T z + eps), a_j = exp(s_j - max s).
 * The buffer then drops its oldest key and takes the new one. l: layer inside the state; ml: model layer. */
static void window_attention(const Plan *p, int l, int ml) {
    const int D = p->D, F = p->F, W = p->W, G = p->H / p->Hkv, QKV = (p->H + 2 * p->Hkv) * D;
    float *phi_k = p->tscratch + att_scratch(p), *phi_q = phi_k + F + 1, *sc = phi_q + F + 1;
    float *krow = sc + W + 1, *vrow = krow + D;
    for (int b = 0; b < p->B; b++) {
        const int cb = cache_seq(p, b);
        const float *q = p->qkv_out + (size_t)b * QKV, *k = q + p->H * D, *v = k + p->Hkv * D;
        const uint8_t *wreal = p->wreal + (size_t)cb * W;
        for (int g = 0; g < p->Hkv; g++) {
            const size_t sg = ((size_t)l * cache_batch(p) + cb) * p->Hkv + g, wb = sg * W * D;
            float *S = p->S + sg * F * D, *z = p->z + sg * F;
            if (wreal[0]) {   /* the oldest key leaves the window: into S, z */
                load_row(p->wk, p->w_type, wb, D, krow);
                load_row(p->wv, p->w_type, wb, D, vrow);
                phi(p, ml, g, 0, krow, phi_k);
                fold_key(S, z, phi_k, vrow, F, D);
            }
            for (int j = 0; j < G; j++) {
                const int h = g * G + j;
                const float *qh = q + h * D;
                float *out = p->att + (size_t)b * p->H * D + h * D, den = 0.0f, mx = -INFINITY;
                for (int t = 1; t < W; t++) {   /* buffered keys 1..W-1, then the query's own */
                    if (!wreal[t]) { sc[t] = -INFINITY; continue; }
                    load_row(p->wk, p->w_type, wb + (size_t)t * D, D, krow);
                    sc[t] = dot_f32(qh, krow, D) * p->scale;
                    if (sc[t] > mx) mx = sc[t];
                }
                sc[W] = dot_f32(qh, k + g * D, D) * p->scale;
                if (sc[W] > mx) mx = sc[W];
                phi(p, ml, h, 1, qh, phi_q);
                den = read_state(S, z, phi_q, F, D, out);
                for (int t = 1; t <= W; t++) {
                    if (t < W && !wreal[t]) continue;
                    const float a = expf(sc[t] - mx);
                    const float *vt = vrow;
                    if (t < W) load_row(p->wv, p->w_type, wb + (size_t)t * D, D, vrow);
                    else vt = v + g * D;
                    den += a;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) out[d] += a * vt[d];
                }
                den += p->lin_eps;
                for (int d = 0; d < D; d++) out[d] /= den;
            }
            /* the buffer drops its oldest key and takes the new one (stored in w_type) */
            const size_t row_bytes = (size_t)D * (p->w_type == T_F32 ? 4 : 2);
            char *wk = (char *)p->wk + wb * (row_bytes / D), *wv = (char *)p->wv + wb * (row_bytes / D);
            memmove(wk, wk + row_bytes, (size_t)(W - 1) * row_bytes);
            memmove(wv, wv + row_bytes, (size_t)(W - 1) * row_bytes);
            store_row(p->wk, p->w_type, wb + (size_t)(W - 1) * D, D, k + g * D);
            store_row(p->wv, p->w_type, wb + (size_t)(W - 1) * D, D, v + g * D);
        }
    }
}

/* ------------------------------------------------------------------ the step */
static void rotate(float *x, const float *cos, const float *sin, int D) {
    int h = D / 2;
    for (int i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* Every layer for the plan's B rows; leaves the residual stream in p->x (B, C). */
static void layers(const Plan *p, const int64_t *tokens, int slot, const float *cos, const float *sin,
                   int rope_stride, const uint8_t *slot_real) {
    const int B = p->B, C = p->C, H = p->H, Hkv = p->Hkv, D = p->D, I = p->I, QKV = (H + 2 * Hkv) * D;
    for (int b = 0; b < B; b++) row_to_f32(&p->embed, (int)tokens[b], p->x + (size_t)b * C);
    for (int l = 0; l < p->L; l++) {
        for (int b = 0; b < B; b++) rms_norm(p->xb + (size_t)b * C, p->x + (size_t)b * C, p->ln1[l], p->norm_type, C, p->eps);
        matmul(p, &p->qkv[l], p->xb, C, p->qkv_out, QKV, 0);
        const int mode = p->layer_mode ? p->layer_mode[l] : p->mode, li = p->layer_index ? p->layer_index[l] : l;
        if (cos && (mode == MODE_SOFTMAX || p->linear_rope))
            for (int b = 0; b < B; b++) {
                float *q = p->qkv_out + (size_t)b * QKV;
                const float *cb = cos + (size_t)b * rope_stride, *sb = sin + (size_t)b * rope_stride;
                for (int h = 0; h < H + Hkv; h++) rotate(q + h * D, cb, sb, D);
            }
        if (mode == MODE_SOFTMAX) softmax_attention(p, li, slot, slot_real);
        else if (p->W > 0) window_attention(p, li, l);
        else linear_attention(p, li, l);
        matmul(p, &p->wo[l], p->att, H * D, p->x, C, 1);
        for (int b = 0; b < B; b++) rms_norm(p->xb + (size_t)b * C, p->x + (size_t)b * C, p->ln2[l], p->norm_type, C, p->eps);
        matmul(p, &p->gu[l], p->xb, C, p->gu_out, 2 * I, 0);
        for (int b = 0; b < B; b++) silu_mul(p->gu_out + (size_t)b * 2 * I, p->hb + (size_t)b * I, I);
        matmul(p, &p->wd[l], p->hb, I, p->x, C, 1);
    }
}

/* Feed tokens (B) at cache slot `slot`. cos/sin: (B, D) rows `rope_stride` apart (NULL: no
 * rotary). slot_real: (B, S_max) bytes, 0 at pad slots (NULL: no pads). Writes logits (B, V). */
void gen_decode_step(const Plan *p, const int64_t *tokens, int slot, const float *cos, const float *sin,
                     int rope_stride, const uint8_t *slot_real, float *logits) {
    const int C = p->C;
    layers(p, tokens, slot, cos, sin, rope_stride, slot_real);
    for (int b = 0; b < p->B; b++) rms_norm(p->xb + (size_t)b * C, p->x + (size_t)b * C, p->norm, p->norm_type, C, p->eps);
    matmul(p, &p->head, p->xb, C, logits, p->V, 0);
}

/* A prompt block on a prefill plan (Bc > 0, made for up to `rows_max` rows): tokens (n) of
 * sequence p->seq at slots slot..slot+n-1, every row on the pool like a batch (its keys and values
 * written before any row attends, each row to the keys up to its own slot). cos/sin: the rotary
 * rows of those positions, D apart. Writes the last row's logits (V) unless logits is NULL. */
void gen_prefill_block(Plan *p, int rows_max, int n, const int64_t *tokens, int slot, const float *cos,
                       const float *sin, const uint8_t *slot_real, float *logits) {
    if (p->Bc <= 0 || n < 1 || n > rows_max) return;
    const int C = p->C;
    pool_quiesce();   /* no late worker still reads this plan's row count */
    p->B = n;
    layers(p, tokens, slot, cos, sin, p->D, slot_real);
    if (logits) {
        float *last = p->xb + (size_t)(n - 1) * C;
        rms_norm(last, p->x + (size_t)(n - 1) * C, p->norm, p->norm_type, C, p->eps);
        pool_quiesce();
        p->B = 1;
        matmul(p, &p->head, last, C, logits, p->V, 0);
    }
    pool_quiesce();
    p->B = rows_max;
}
