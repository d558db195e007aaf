/* Softmax attention of the native step over a KV cache (L, B, Hkv, S_max, D) in kv_type: the
 * block's keys and values written at their slots, then per KV group the scores of its G query heads
 * against every real cached key read once (fp32 rows, or 16-bit rows read in place; pads left
 * out, so a row's sums do not depend on its neighbours), the weighted sum of the values. Runs on
 * the pool by KV groups (decode.c calls it).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"

/* ------------------------------------------------------------------ softmax attention */
typedef struct { const Plan *p; int l, slot; const uint8_t *slot_real; } AttCtx;

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

/* sc (n) <- softmax(scale * sc) in place (every key real: att_fn leaves pads out). Scale, max,
 * exp and the division in 16 lanes (each element as the scalar form computes it); the sum in
 * order: a reassociated sum moves the weights' last bits, and a quantized o_proj rounds its inputs
 * to q8, which turns a last bit into a step (the q8 twin's logits moved by 7e-2 with a 16-lane sum). */
static void softmax_scores(float *sc, int n, float scale) {
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
#elif defined(GEN_EXP8)
    const __m256 s = _mm256_set1_ps(scale);
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(sc + t), s);
        _mm256_storeu_ps(sc + t, v);
        m = _mm256_max_ps(m, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) if (lanes[i] > mx) mx = lanes[i];
    for (int u = t; u < n; u++) { sc[u] *= scale; if (sc[u] > mx) mx = sc[u]; }
    const __m256 vmx = _mm256_set1_ps(mx);
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(sc + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vmx)));
    if (t < n) {   /* the tail through the same exp: every weight computed alike */
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = t + i < n ? sc[t + i] : -INFINITY;
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vmx)));
        for (int i = 0; t + i < n; i++) sc[t + i] = tail[i];
    }
    for (t = 0; t < n; t++) sum += sc[t];   /* in order, as the scalar form and PyTorch's short rows */
    const __m256 vs = _mm256_set1_ps(sum);
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(sc + t, _mm256_div_ps(_mm256_loadu_ps(sc + t), vs));
    for (; t < n; t++) sc[t] /= sum;
#else
    for (; t < n; t++) { sc[t] *= scale; if (sc[t] > mx) mx = sc[t]; }
    for (t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    for (t = 0; t < n; t++) sc[t] /= sum;
#endif
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
                    float *sc, float *o) {
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
        softmax_scores(sc + (size_t)j * p->S_max, n, p->scale);
        if (type == T_F16) weighted16(sc + (size_t)j * p->S_max, V, n, D, T_F16, o + j * D);
        else weighted16(sc + (size_t)j * p->S_max, V, n, D, T_BF16, o + j * D);
    }
}
#endif

/* One KV group's attention over n keys and values, all real (the row's own slot last): K, V point at
 * the first key's row in kv_type (element index 0), q and o G heads of D. */
static void attend_group(const Plan *p, const float *q, const void *K, const void *V, int n, int G, float *scratch,
                         float *o) {
    const int D = p->D;
    const int fast = p->kv_type == T_F32 && D % 8 == 0;
    const int widen = p->kv_type != T_F32 && D % 8 == 0;   /* 16-bit cache: KCH rows at a time */
    float *sc = scratch, *row = sc + (size_t)G * p->S_max, *acc = row + D, *tmp = acc + (size_t)G * D, *blk = tmp + D;
    const float *Kf = K, *Vf = V;
#ifdef GEN_AVX512
    if (p->kv_type != T_F32 && D % 16 == 0) {
        group16(p, q, K, V, n, G, sc, o);
        return;
    }
#endif
    int t = 0;
    if (fast) {
        for (; t + 8 <= n; t += 8) {
            /* the same keys' values, next: their stream runs beside the keys' (measured on tiny,
             * B = 8 at depth 178 out of DRAM: attention 1.53-1.64 -> 1.37-1.45 ms) */
            for (int i = 0; i < 8 * D; i += 16) __builtin_prefetch(Vf + (size_t)t * D + i);
            for (int j = 0; j < G; j++) dot8(q + j * D, Kf + (size_t)t * D, D, sc + (size_t)j * p->S_max + t);
        }
        for (; t + 4 <= n; t += 4)
            for (int j = 0; j < G; j++) dot4(q + j * D, Kf + (size_t)t * D, D, sc + (size_t)j * p->S_max + t);
    }
    if (widen)
        for (; t < n; t += KCH) {
            int m = n - t < KCH ? n - t : KCH;
            load_row(K, p->kv_type, (size_t)t * D, m * D, blk);
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
        if (p->kv_type == T_F32) key = Kf + (size_t)t * D;
        else load_row(K, p->kv_type, (size_t)t * D, D, row);
        for (int j = 0; j < G; j++) sc[(size_t)j * p->S_max + t] = dot_f32(q + j * D, key, D);
    }
    for (int j = 0; j < G; j++) softmax_scores(sc + (size_t)j * p->S_max, n, p->scale);
    if (fast && G == 1) {
        weighted_rows(sc, Vf, n, D, o);
        return;
    }
    memset(acc, 0, (size_t)G * D * sizeof(float));
    if (fast || widen) {   /* KCH value rows at a time, used by every head of the group */
        for (t = 0; t < n; t += KCH) {
            int m = n - t < KCH ? n - t : KCH;
            const float *vb = Vf + (size_t)t * D;
            if (widen) { load_row(V, p->kv_type, (size_t)t * D, m * D, blk); vb = blk; }
            for (int j = 0; j < G; j++) {
                weighted_rows(sc + (size_t)j * p->S_max + t, vb, m, D, tmp);
                for (int d = 0; d < D; d++) acc[j * D + d] += tmp[d];
            }
        }
    } else {
        for (t = 0; t < n; t++) {
            load_row(V, p->kv_type, (size_t)t * D, D, row);
            for (int j = 0; j < G; j++)
                if (sc[(size_t)j * p->S_max + t] != 0.0f) axpy_f32(acc + j * D, sc[(size_t)j * p->S_max + t], row, D);
        }
    }
    memcpy(o, acc, (size_t)G * D * sizeof(float));
}

/* Units [u0, u1) of (row, KV group) pairs, u = b*Hkv + g: out[(u - u0)*G*D + j*D + d] for the group's G
 * query heads j (the units of one row side by side are that row of att: the pool runs the pairs as
 * one row of B*H*D columns, so rows of different lengths spread over the threads). Each key and
 * value row is read once per group (from memory; the group's other heads take it from L1): GQA
 * reads the cache once, not once per query head.
 *
 * A row attends to its real keys only, as if they were all it held: leading pad slots are skipped
 * (the keys start at its first real slot), and a row with pads between real slots attends to a
 * packed copy of its real keys and values. So a row computes exactly what it computes alone, in a
 * batch of any lengths, on any split over threads: every blocked loop above (8 and 4 keys per dot,
 * KCH values per partial sum) groups the same keys the same way (PITFALLS #22). */
static void att_fn(const void *ctx, int u0, int u1, float *out, int os, int add, float *scratch) {
    const AttCtx *c = ctx;
    const Plan *p = c->p;
    const int D = p->D, G = p->H / p->Hkv, QKV = (p->H + 2 * p->Hkv) * D, Bc = cache_batch(p);
    const size_t es = p->kv_type == T_F32 ? 4 : 2, row_bytes = (size_t)D * es;
    char *packed = NULL;   /* (2, n, D) in kv_type: a row's real keys, then its real values */
    (void)add; (void)os;
    int b = -1, cb = 0, slot = 0, t0 = 0, gaps = 0, n = 0;
    const uint8_t *real = NULL;
    for (int u = u0; u < u1; u++) {
        const int g = u % p->Hkv;
        if (u / p->Hkv != b) {   /* a new row: where its real keys start, and whether pads lie between */
            b = u / p->Hkv;
            cb = cache_seq(p, b);
            slot = row_slot(p, c->slot, b);
            real = c->slot_real ? c->slot_real + (size_t)cb * p->S_max : NULL;
            t0 = 0, gaps = 0;
            if (real) {
                const uint8_t *first = memchr(real, 1, (size_t)slot);   /* bools: 0 or 1; a cache with */
                t0 = first ? (int)(first - real) : slot;                 /* headroom leads with many pads */
                for (int t = t0; t < slot && !gaps; t++) gaps = !real[t];
            }
            n = slot + 1 - t0;
            if (gaps) {
                n = 1;
                for (int t = t0; t < slot; t++) n += real[t] != 0;
                packed = realloc(packed, 2 * (size_t)(slot + 1) * row_bytes);
                if (!packed) abort();
            }
        }
        const float *q = p->qkv_out + (size_t)b * QKV + (size_t)g * G * D;   /* head j: q + j*D */
        const size_t base = (((size_t)c->l * Bc + cb) * p->Hkv + g) * p->S_max * D;
        const char *K = (const char *)p->k + (base + (size_t)t0 * D) * es;
        const char *V = (const char *)p->v + (base + (size_t)t0 * D) * es;
        float *o = out + (size_t)(u - u0) * G * D;   /* head j: o + j*D */
        if (gaps) {
            char *pk = packed, *pv = packed + (size_t)n * row_bytes;
            for (int t = t0, i = 0; t <= slot; t++)
                if (real[t] || t == slot) {
                    memcpy(pk + (size_t)i * row_bytes, K + (size_t)(t - t0) * row_bytes, row_bytes);
                    memcpy(pv + (size_t)i * row_bytes, V + (size_t)(t - t0) * row_bytes, row_bytes);
                    i++;
                }
            K = pk;
            V = pv;
        }
        attend_group(p, q, K, V, n, G, scratch, o);
    }
    free(packed);
}

void softmax_attention(const Plan *p, int l, int slot, const uint8_t *slot_real) {
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
    const int units = p->B * p->Hkv;   /* (row, KV group) pairs, each G heads wide: att as one row */
    if (p->nthreads <= 1 || macs < gen_par_min_macs) {
        att_fn(&c, 0, units, p->att, units * (p->H / p->Hkv) * D, 0, p->tscratch);
        return;
    }
    int per = (units + p->nthreads * CHUNKS_PER_THREAD - 1) / (p->nthreads * CHUNKS_PER_THREAD);
    pool_run(p->nthreads, att_fn, &c, sizeof c, units, (p->H / p->Hkv) * D, per, 1, p->att, p->B * p->H * D, 0,
             p->tscratch, p->tscratch_floats, fn_scratch(p));
}
