/* Linear attention of the native step as an RNN over (S, z) (L, B, Hkv, F, D) / (L, B, Hkv, F)
 * fp32: the fixed feature maps and the learned (hedgehog) ones, the plain recurrence, and sliding
 * window + linear (a buffer of the W newest keys and values beside S, z). decode.c calls it per layer.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"

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

/* S = diag(g) S + phi_k v^T, z = g z + phi_k: a learned decay's factors g (F), in one pass over S. */
static inline void fold_key_decayed(float *S, float *z, const float *phi_k, const float *v, const float *g,
                                    int F, int D) {
    for (int f = 0; f < F; f++) {
        const float a = phi_k[f], gf = g[f];
        #pragma omp simd
        for (int d = 0; d < D; d++) S[f * D + d] = S[f * D + d] * gf + a * v[d];
        z[f] = z[f] * gf + a;
    }
}

/* S = diag(g) S, z = g z: a learned decay's factors g (F) with no key to fold in. */
static inline void decay_state(float *S, float *z, const float *g, int F, int D) {
    for (int f = 0; f < F; f++) {
        const float gf = g[f];
        #pragma omp simd
        for (int d = 0; d < D; d++) S[f * D + d] *= gf;
        z[f] *= gf;
    }
}

/* A gated decay's factors for one token and key/value head: g (F) = exp(-sigmoid(logit + rms(v) gate)),
 * logit (F), gate (D, F); as engine.attention.feature_maps.Hedgehog.decay. */
static void gate_factors(const float *v, const float *logit, const float *gate, int F, int D, float *g) {
    float ss = 0.0f;
    for (int d = 0; d < D; d++) ss += v[d] * v[d];
    const float r = 1.0f / sqrtf(ss / (float)D + 1e-6f);
    for (int f = 0; f < F; f++) g[f] = logit[f];
    for (int d = 0; d < D; d++) {
        const float u = v[d] * r, *row = gate + (size_t)d * F;
        #pragma omp simd
        for (int f = 0; f < F; f++) g[f] += u * row[f];
    }
    for (int f = 0; f < F; f++) g[f] = expf(-1.0f / (1.0f + expf(-g[f])));
}

/* The decay factors (F) of the token whose value is v (D) in model layer ml's key/value head g: the
 * constant ones, a gated decay's computed into gt, or NULL when the maps carry no decay. */
static inline const float *token_factors(const Plan *p, int ml, int g, const float *v, float *gt) {
    const size_t lg = (size_t)ml * p->Hkv + g;
    if (p->hh_gate) {
        gate_factors(v, p->hh_logit + lg * p->F, p->hh_gate + lg * p->D * p->F, p->F, p->D, gt);
        return gt;
    }
    return p->hh_decay ? p->hh_decay + lg * p->F : NULL;
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

/* One token per row: S += phi(k) v^T, z += phi(k) (after S, z take a learned decay's factors, when
 * the maps carry one: a constant per feature, or a gated one computed from the token's value); out_h = phi(q_h)^T S / (phi(q_h)^T z + eps).
 * l: the layer inside the linear state; ml: the model layer (learned maps are per model layer). */
void linear_attention(const Plan *p, int l, int ml) {
    const int D = p->D, F = p->F, G = p->H / p->Hkv, QKV = (p->H + 2 * p->Hkv) * D;
    float *phi_k = p->tscratch + att_scratch(p), *phi_q = phi_k + F + 1;
    float *gt = phi_q + F + 1 + p->W + 1 + 2 * D;   /* a gated decay's factors (fn_scratch's last F + 1) */
    for (int b = 0; b < p->B; b++) {
        const float *q = p->qkv_out + (size_t)b * QKV, *k = q + p->H * D, *v = k + p->Hkv * D;
        for (int g = 0; g < p->Hkv; g++) {
            size_t sg = ((size_t)l * cache_batch(p) + cache_seq(p, b)) * p->Hkv + g;
            float *S = p->S + sg * F * D, *z = p->z + sg * F;
            const float *vg = v + g * D;
            phi(p, ml, g, 0, k + g * D, phi_k);
            const float *gf = token_factors(p, ml, g, vg, gt);
            if (gf) fold_key_decayed(S, z, phi_k, vg, gf, F, D);
            else fold_key(S, z, phi_k, vg, F, D);
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

/* Sliding window + linear, one token per row (engine/attention/window.py with T = 1): S, z take the
 * token's decay factors (learned maps with a decay), the oldest buffered key leaves the window into S, z; the query attends exactly to the other W - 1 buffered
 * keys and its own, and through phi to S, z, in one normalisation:
 *   out = (sum_j a_j v_j + phi(q)^T S) / (sum_j a_j + phi(q)^T z + eps), a_j = exp(s_j - max s).
 * The buffer then drops its oldest key and takes the new one. l: layer inside the state; ml: model layer. */
void window_attention(const Plan *p, int l, int ml) {
    const int D = p->D, F = p->F, W = p->W, G = p->H / p->Hkv, QKV = (p->H + 2 * p->Hkv) * D;
    float *phi_k = p->tscratch + att_scratch(p), *phi_q = phi_k + F + 1, *sc = phi_q + F + 1;
    float *krow = sc + W + 1, *vrow = krow + D, *gt = vrow + D;   /* gt: a gated decay's factors */
    for (int b = 0; b < p->B; b++) {
        const int cb = cache_seq(p, b);
        const float *q = p->qkv_out + (size_t)b * QKV, *k = q + p->H * D, *v = k + p->Hkv * D;
        const uint8_t *wreal = p->wreal + (size_t)cb * W;
        /* a prompt plan's row b is the block's token b: the rows before it moved the buffer b slots on
         * (their keys real), while wreal is shifted only after the block (WindowState.commit) */
        const int shift = prompt_plan(p) ? b : 0;
#define WREAL(t) ((t) + shift < W ? wreal[(t) + shift] : 1)
        for (int g = 0; g < p->Hkv; g++) {
            const size_t sg = ((size_t)l * cache_batch(p) + cb) * p->Hkv + g, wb = sg * W * D;
            float *S = p->S + sg * F * D, *z = p->z + sg * F;
            const float *gf = token_factors(p, ml, g, v + g * D, gt);
            if (WREAL(0)) {   /* the oldest key leaves the window: into S, z */
                load_row(p->wk, p->w_type, wb, D, krow);
                load_row(p->wv, p->w_type, wb, D, vrow);
                phi(p, ml, g, 0, krow, phi_k);
                if (gf) fold_key_decayed(S, z, phi_k, vrow, gf, F, D);
                else fold_key(S, z, phi_k, vrow, F, D);
            } else if (gf) decay_state(S, z, gf, F, D);
            for (int j = 0; j < G; j++) {
                const int h = g * G + j;
                const float *qh = q + h * D;
                float *out = p->att + (size_t)b * p->H * D + h * D, den = 0.0f, mx = -INFINITY;
                for (int t = 1; t < W; t++) {   /* buffered keys 1..W-1, then the query's own */
                    if (!WREAL(t)) { sc[t] = -INFINITY; continue; }
                    load_row(p->wk, p->w_type, wb + (size_t)t * D, D, krow);
                    sc[t] = dot_f32(qh, krow, D) * p->scale;
                    if (sc[t] > mx) mx = sc[t];
                }
                sc[W] = dot_f32(qh, k + g * D, D) * p->scale;
                if (sc[W] > mx) mx = sc[W];
                phi(p, ml, h, 1, qh, phi_q);
                den = read_state(S, z, phi_q, F, D, out);
                for (int t = 1; t <= W; t++) {
                    if (t < W && !WREAL(t)) continue;
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
#undef WREAL
    }
}

/* Sliding window + a sparse cache of hard keys, one token per row (engine/attention/sparse.py with
 * T = 1): S, z take the token's decay factors (learned maps with a decay), then the query attends exactly to the row's held recent keys, its own and the cached ones in
 * use, and through phi to S, z, in one normalisation (as window_attention); then its key and value
 * join the recent ones (the held ones move one slot left). In a prompt plan the rows are one
 * sequence's consecutive tokens, within one 64-token block (the caller splits there): row r sees the
 * held keys and rows 0..r-1, appended in turn. l: layer inside the state; ml: model layer. */
void sparse_attention(const Plan *p, int l, int ml) {
    const int D = p->D, F = p->F, R = p->R, M = p->M, G = p->H / p->Hkv, QKV = (p->H + 2 * p->Hkv) * D;
    float *phi_q = p->tscratch + att_scratch(p) + F + 1, *sc = phi_q + F + 1;
    float *krow = sc + R + M + 1, *vrow = krow + D, *gt = vrow + D;   /* gt: a gated decay's factors */
    const size_t row_bytes = (size_t)D * (p->w_type == T_F32 ? 4 : 2);
    for (int b = 0; b < p->B; b++) {
        const int cb = cache_seq(p, b), h = p->sp_held[cb] + (prompt_plan(p) ? b : 0);
        const float *q = p->qkv_out + (size_t)b * QKV, *k = q + p->H * D, *v = k + p->Hkv * D;
        for (int g = 0; g < p->Hkv; g++) {
            const size_t sg = ((size_t)l * cache_batch(p) + cb) * p->Hkv + g, rb = sg * R * D, cbase = sg * M * D;
            float *S = p->S + sg * F * D, *z = p->z + sg * F;
            const uint8_t *use = p->cuse + sg * M;
            const float *gf = token_factors(p, ml, g, v + g * D, gt);
            if (gf) decay_state(S, z, gf, F, D);
            for (int j = 0; j < G; j++) {
                const int hh = g * G + j;
                const float *qh = q + hh * D;
                float *out = p->att + (size_t)b * p->H * D + hh * D, mx = -INFINITY;
                for (int t = 0; t < h; t++) {   /* scores: held keys, the query's own, cached keys */
                    load_row(p->rk, p->w_type, rb + (size_t)(R - h + t) * D, D, krow);
                    sc[t] = dot_f32(qh, krow, D) * p->scale;
                    if (sc[t] > mx) mx = sc[t];
                }
                sc[h] = dot_f32(qh, k + g * D, D) * p->scale;
                if (sc[h] > mx) mx = sc[h];
                for (int i = 0; i < M; i++) {
                    if (!use[i]) continue;
                    load_row(p->ck, p->w_type, cbase + (size_t)i * D, D, krow);
                    sc[h + 1 + i] = dot_f32(qh, krow, D) * p->scale;
                    if (sc[h + 1 + i] > mx) mx = sc[h + 1 + i];
                }
                phi(p, ml, hh, 1, qh, phi_q);
                float den = read_state(S, z, phi_q, F, D, out);
                for (int t = 0; t <= h + M; t++) {
                    const float *vt = vrow;
                    if (t < h) load_row(p->rv, p->w_type, rb + (size_t)(R - h + t) * D, D, vrow);
                    else if (t == h) vt = v + g * D;
                    else if (use[t - h - 1]) load_row(p->cv, p->w_type, cbase + (size_t)(t - h - 1) * D, D, vrow);
                    else continue;
                    const float a = expf(sc[t] - mx);
                    den += a;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) out[d] += a * vt[d];
                }
                den += p->lin_eps;
                for (int d = 0; d < D; d++) out[d] /= den;
            }
            char *rk = (char *)p->rk + rb * (row_bytes / D), *rv = (char *)p->rv + rb * (row_bytes / D);
            memmove(rk + (size_t)(R - h - 1) * row_bytes, rk + (size_t)(R - h) * row_bytes, (size_t)h * row_bytes);
            memmove(rv + (size_t)(R - h - 1) * row_bytes, rv + (size_t)(R - h) * row_bytes, (size_t)h * row_bytes);
            store_row(p->rk, p->w_type, rb + (size_t)(R - 1) * D, D, k + g * D);
            store_row(p->rv, p->w_type, rb + (size_t)(R - 1) * D, D, v + g * D);
        }
    }
}
