/* One decode step of a Llama-shaped model, batch 1, fp32: softmax attention over a KV cache,
 * or linear attention as an RNN over (S, z).
 *
 * The native twin of models/decode.py:decode_one for the case that dominates interactive use.
 * It reads the model's own weight tensors and writes the KVState's own cache tensors (no
 * copies): the Python side passes their data pointers once, in a Plan. Layouts are torch's:
 * a Linear weight is (out, in) row-major; the cache is (L, 1, Hkv, S_max, D), the linear
 * state S (L, 1, Hkv, F, D) and z (L, 1, Hkv, F); rotary tables are (n, D) cos and sin in the
 * half-split layout. Feature maps as engine/attention/feature_maps.py. Built by engine/native/__init__.py with
 * -O3 -march=native -fopenmp-simd (vectorised reductions without -ffast-math).
 */
#include <math.h>
#include <stddef.h>

typedef struct {
    int L, C, H, Hkv, D, I, V, S_max;
    float eps, scale;
    const float *embed, *norm, *head;
    const float *const *ln1, *const *wqkv, *const *wo, *const *ln2, *const *wgu, *const *wd;
    float *k, *v;                                      /* (L, Hkv, S_max, D) */
    float *x, *xb, *qkv, *att, *gu, *hb, *scores;      /* scratch */
    int mode, F;                                       /* MODE_*; feature width (linear) */
    float lin_eps;                                     /* linear: out = num / (den + lin_eps) */
    float *S, *z, *phi_q, *phi_k;                      /* linear state; scratch (F each) */
} Plan;

enum { MODE_SOFTMAX = 0, MODE_ELU1 = 1, MODE_RELU = 2, MODE_SOFTMAX_MAP = 3, MODE_COS1 = 4 };

/* phi(x): x (D) -> out (F) */
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

/* One token of S += phi(k) v^T, z += phi(k); out_h = phi(q_h)^T S / (phi(q_h)^T z + eps). */
static void linear_attend(const Plan *p, int l, const float *q, const float *k, const float *v) {
    const int D = p->D, F = p->F, G = p->H / p->Hkv;
    for (int g = 0; g < p->Hkv; g++) {
        float *S = p->S + ((size_t)l * p->Hkv + g) * F * D, *z = p->z + ((size_t)l * p->Hkv + g) * F;
        const float *vg = v + g * D;
        feature_map(p->mode, k + g * D, p->phi_k, D);
        for (int f = 0; f < F; f++) {
            float a = p->phi_k[f];
            #pragma omp simd
            for (int d = 0; d < D; d++) S[f * D + d] += a * vg[d];
            z[f] += a;
        }
        for (int j = 0; j < G; j++) {
            int h = g * G + j;
            feature_map(p->mode, q + h * D, p->phi_q, D);
            float *out = p->att + h * D, den = 0.0f;
            for (int d = 0; d < D; d++) out[d] = 0.0f;
            for (int f = 0; f < F; f++) {
                float a = p->phi_q[f];
                den += a * z[f];
                #pragma omp simd
                for (int d = 0; d < D; d++) out[d] += a * S[f * D + d];
            }
            den += p->lin_eps;
            for (int d = 0; d < D; d++) out[d] /= den;
        }
    }
}

/* out (rows) = W (rows, cols) . x, or out += W . x when `add` */
static void matvec(float *out, const float *w, const float *x, int rows, int cols, int add) {
    for (int r = 0; r < rows; r++) {
        const float *row = w + (size_t)r * cols;
        float s = 0.0f;
        #pragma omp simd reduction(+:s)
        for (int c = 0; c < cols; c++) s += row[c] * x[c];
        out[r] = add ? out[r] + s : s;
    }
}

static void rms_norm(float *out, const float *x, const float *w, int n, float eps) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

static void rotate(float *x, const float *cos, const float *sin, int D) {
    int h = D / 2;
    for (int i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* Feed `token` at slot `pos`; cos/sin: that position's rows (NULL: no rotary). Writes V logits. */
void gen_decode_step(const Plan *p, int token, int pos, const float *cos, const float *sin, float *logits) {
    const int C = p->C, H = p->H, Hkv = p->Hkv, D = p->D, I = p->I, G = p->H / p->Hkv;
    const size_t layer_stride = (size_t)Hkv * p->S_max * D, head_stride = (size_t)p->S_max * D;
    float *x = p->x;
    for (int i = 0; i < C; i++) x[i] = p->embed[(size_t)token * C + i];
    for (int l = 0; l < p->L; l++) {
        rms_norm(p->xb, x, p->ln1[l], C, p->eps);
        matvec(p->qkv, p->wqkv[l], p->xb, (H + 2 * Hkv) * D, C, 0);
        float *q = p->qkv, *k = q + H * D, *v = k + Hkv * D;
        if (cos) {
            for (int h = 0; h < H; h++) rotate(q + h * D, cos, sin, D);
            for (int h = 0; h < Hkv; h++) rotate(k + h * D, cos, sin, D);
        }
        if (p->mode != MODE_SOFTMAX) {
            linear_attend(p, l, q, k, v);
        } else {
            float *kc = p->k + l * layer_stride, *vc = p->v + l * layer_stride;
            for (int h = 0; h < Hkv; h++)
                for (int d = 0; d < D; d++) {
                    kc[h * head_stride + (size_t)pos * D + d] = k[h * D + d];
                    vc[h * head_stride + (size_t)pos * D + d] = v[h * D + d];
                }
            for (int h = 0; h < H; h++) {
                const float *qh = q + h * D;
                const float *keys = kc + (h / G) * head_stride, *vals = vc + (h / G) * head_stride;
                float *sc = p->scores, mx = -INFINITY;
                for (int t = 0; t <= pos; t++) {
                    float s = 0.0f;
                    #pragma omp simd reduction(+:s)
                    for (int d = 0; d < D; d++) s += qh[d] * keys[(size_t)t * D + d];
                    sc[t] = s * p->scale;
                    if (sc[t] > mx) mx = sc[t];
                }
                float sum = 0.0f;
                for (int t = 0; t <= pos; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
                float *out = p->att + h * D;
                for (int d = 0; d < D; d++) out[d] = 0.0f;
                for (int t = 0; t <= pos; t++) {
                    float a = sc[t] / sum;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) out[d] += a * vals[(size_t)t * D + d];
                }
            }
        }
        matvec(x, p->wo[l], p->att, C, H * D, 1);
        rms_norm(p->xb, x, p->ln2[l], C, p->eps);
        matvec(p->gu, p->wgu[l], p->xb, 2 * I, C, 0);
        for (int i = 0; i < I; i++) {
            float g = p->gu[i];
            p->hb[i] = g / (1.0f + expf(-g)) * p->gu[I + i];
        }
        matvec(x, p->wd[l], p->hb, C, I, 1);
    }
    rms_norm(p->xb, x, p->norm, C, p->eps);
    matvec(logits, p->head, p->xb, p->V, C, 0);
}
