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
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"

/* A phase below this many multiply-adds runs on the caller alone (tests set 0: every phase on the pool).
 * 65536, not 24576: on the Zen 3 VM the hand-off of a ~33k-MAC phase (stories260K's lm_head) cost
 * more than it saved, 2 threads interleaved in one process: stories260K at depth 1 111 -> 82 us a
 * step, at depth 128 130 -> 103; tiny level (490 -> 430, 550 -> 521); larger phases are unchanged. */
long long gen_par_min_macs = 65536;
void gen_set_parallel_min(long long macs) { gen_par_min_macs = macs; }

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

/* ------------------------------------------------------------------ the layout the Python side mirrors */
/* engine/steps/native/abi.py fills Mat and Plan through ctypes copies of their declarations; at bind
 * time it compares its copies' field names, byte offsets and sizes with these tables (and the
 * version, which moves when a field's meaning changes without its layout), so a field added,
 * moved or retyped on one side only is one clear error instead of a plan read at the wrong bytes;
 * likewise its type codes of the block kinds with KIND_ABI. */
#define GEN_ABI_VERSION 1
#define ABI_FIELD(S, f) {#f, offsetof(S, f), sizeof(((S *)0)->f)},
#define MAT_FIELDS(X) X(Mat, data) X(Mat, type) X(Mat, rows) X(Mat, cols) X(Mat, split) X(Mat, rest)
#define PLAN_FIELDS(X) \
    X(Plan, L) X(Plan, C) X(Plan, H) X(Plan, Hkv) X(Plan, D) X(Plan, I) X(Plan, V) X(Plan, B) X(Plan, S_max) \
    X(Plan, eps) X(Plan, scale) X(Plan, embed) X(Plan, head) X(Plan, norm) X(Plan, norm_type) \
    X(Plan, qkv) X(Plan, wo) X(Plan, gu) X(Plan, wd) X(Plan, ln1) X(Plan, ln2) \
    X(Plan, k) X(Plan, v) X(Plan, kv_type) X(Plan, mode) X(Plan, F) X(Plan, lin_eps) X(Plan, S) X(Plan, z) \
    X(Plan, x) X(Plan, xb) X(Plan, qkv_out) X(Plan, att) X(Plan, gu_out) X(Plan, hb) \
    X(Plan, nthreads) X(Plan, tscratch) X(Plan, tscratch_floats) X(Plan, Bc) X(Plan, seq) \
    X(Plan, hq_w) X(Plan, hq_b) X(Plan, hk_w) X(Plan, hk_b) X(Plan, hh_type) \
    X(Plan, layer_mode) X(Plan, layer_index) X(Plan, linear_rope) \
    X(Plan, wk) X(Plan, wv) X(Plan, wreal) X(Plan, W) X(Plan, w_type) \
    X(Plan, hh_decay) X(Plan, hh_logit) X(Plan, hh_gate) X(Plan, q8_acts) X(Plan, qkv_bias) X(Plan, q_norm) X(Plan, k_norm) \
    X(Plan, rk) X(Plan, rv) X(Plan, ck) X(Plan, cv) X(Plan, cuse) X(Plan, sp_held) X(Plan, R) X(Plan, M)

typedef struct { const char *name; size_t offset, size; } AbiField;
static const AbiField MAT_ABI[] = {MAT_FIELDS(ABI_FIELD)};
static const AbiField PLAN_ABI[] = {PLAN_FIELDS(ABI_FIELD)};

/* The block kinds Mat.type names, as engine.quant names them: "offset" is the type code, "size" the
 * bytes of one block (32 weights; K-quants a super-block of 256). Table 2 of gen_abi. */
#define KIND(name, code, bytes) {name, code, bytes},
static const AbiField KIND_ABI[] = {
    KIND("q8_0", T_Q8_0, 2 + QK) KIND("q4_0", T_Q4_0, 2 + QK / 2) KIND("q4_1", T_Q4_1, 4 + QK / 2)
    KIND("q5_0", T_Q5_0, 6 + QK / 2) KIND("q5_1", T_Q5_1, 8 + QK / 2)
    KIND("q4_k", T_Q4_K, 144) KIND("q5_k", T_Q5_K, 176) KIND("q6_k", T_Q6_K, 210)};

int gen_abi_version(void) { return GEN_ABI_VERSION; }

int gen_abi(int s, int i, const char **name, size_t *offset, size_t *size) {
    const AbiField *t = s == 0 ? MAT_ABI : s == 1 ? PLAN_ABI : s == 2 ? KIND_ABI : NULL;
    const int n = s == 0 ? (int)(sizeof MAT_ABI / sizeof *MAT_ABI) : s == 1 ? (int)(sizeof PLAN_ABI / sizeof *PLAN_ABI)
                                                                            : (int)(sizeof KIND_ABI / sizeof *KIND_ABI);
    if (!t || i < -1 || i >= n) return -1;
    if (i == -1) {
        *name = s == 0 ? "Mat" : s == 1 ? "Plan" : "kinds";
        *offset = 0;
        *size = s == 0 ? sizeof(Mat) : s == 1 ? sizeof(Plan) : 0;
    } else {
        *name = t[i].name;
        *offset = t[i].offset;
        *size = t[i].size;
    }
    return 0;
}

/* ------------------------------------------------------------------ matrices on the pool */
typedef struct { Mat m; const float *x; int xs, B; const void *qx; int dq; } MatCtx;

/* Quantized rows [r0, r1) against fp32 inputs, DQ_ROWS rows at a time widened into buf (the values
 * dequantize() gives) and run by the float kernels: a prompt block's rows share each widened row. */
static void dq_rows(const Mat *m, int r0, int r1, const float *x, int xs, int B, float *out, int os, int add,
                    float *buf) {
    for (int r = r0; r < r1; r += DQ_ROWS) {
        const int n = r1 - r < DQ_ROWS ? r1 - r : DQ_ROWS;
        for (int i = 0; i < n; i++) row_to_f32(m, r + i, buf + (size_t)i * m->cols);
        Mat t = {buf, T_F32, n, m->cols};
        mat_rows(&t, 0, n, x, xs, B, out + (r - r0), os, add);
    }
}

static void mat_fn(const void *ctx, int r0, int r1, float *out, int os, int add, float *scratch) {
    const MatCtx *c = ctx;
    int base = 0;   /* a stack's segments (gen.h Mat.rest): each its rows of [r0, r1) on its own kernel */
    for (const Mat *m = &c->m; m && base < r1; m = m->rest) {
        Mat seg = *m;
        seg.rest = NULL;
        if (m->rest) seg.rows = m->split;
        const int a = r0 > base ? r0 : base, e = r1 < base + seg.rows ? r1 : base + seg.rows;
        if (a < e) {
            float *o = out + (a - r0);
            if (c->qx) qmat_rows(&seg, a - base, e - base, c->qx, c->B, o, os, add);
            else if (c->dq) dq_rows(&seg, a - base, e - base, c->x, c->xs, c->B, o, os, add, scratch);
            else mat_rows(&seg, a - base, e - base, c->x, c->xs, c->B, o, os, add);
        }
        base += seg.rows;
    }
}

/* out (B, os) (+)= x (B, xs) @ m^T */
static void matmul(const Plan *p, const Mat *m, const float *x, int xs, float *out, int os, int add) {
    long long macs = (long long)m->rows * m->cols * p->B;
    const void *qx = NULL;
    if (m->type >= T_Q8_0 && p->q8_acts) {   /* quantized weights: x rounded to q8 blocks once, integer dots (qdot.c) */
        void *buf = p->tscratch + p->tscratch_floats * p->nthreads;
        quantize_x(x, xs, p->B, m->cols, buf, m->type);
        qx = buf;
    }
    /* a prompt plan's fp32 activations on quantized blocks (q8_0 / q4_0 / q4_1, regrouped or not, the
     * K-quants; a stack's segments): widened DQ_ROWS rows at a time */
    const int dq = !qx && dq_scratch(p) > 0 && p->B >= 4 && m->type >= T_Q8_0;
    MatCtx c = {*m, x, xs, p->B, qx, dq};
    if (p->nthreads <= 1 || macs < gen_par_min_macs) {
        mat_fn(&c, 0, m->rows, out, os, add, p->tscratch);
        return;
    }
    int chunks = p->nthreads * CHUNKS_PER_THREAD, rows = (m->rows + chunks - 1) / chunks;
    rows = (rows + 7) & ~7;
    if ((m->rows + rows - 1) / rows > 64) rows = (m->rows + 63) / 64;
    pool_run(p->nthreads, mat_fn, &c, sizeof c, m->rows, 1, rows, p->B, out, os, add,
             p->tscratch, p->tscratch_floats, fn_scratch(p));
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
#elif defined(GEN_EXP8)
    for (; i + 8 <= I; i += 8) {
        __m256 g = _mm256_loadu_ps(gu + i), e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 sg = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(hb + i, _mm256_mul_ps(sg, _mm256_loadu_ps(gu + I + i)));
    }
#endif
    for (; i < I; i++) hb[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[I + i];
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

/* Layers [l0, l1) for the plan's B rows (l0 == 0: the tokens' embeddings first); the residual
 * stream is in p->x (B, C) before and after, so a block can run in pieces of layers. */
static void layers(const Plan *p, const int64_t *tokens, int slot, const float *cos, const float *sin,
                   int rope_stride, const uint8_t *slot_real, int l0, int l1) {
    const int B = p->B, C = p->C, H = p->H, Hkv = p->Hkv, D = p->D, I = p->I, QKV = (H + 2 * Hkv) * D;
    if (l0 == 0)
        for (int b = 0; b < B; b++) row_to_f32(&p->embed, (int)tokens[b], p->x + (size_t)b * C);
    for (int l = l0; l < l1; l++) {
        for (int b = 0; b < B; b++) rms_norm(p->xb + (size_t)b * C, p->x + (size_t)b * C, p->ln1[l], p->norm_type, C, p->eps);
        matmul(p, &p->qkv[l], p->xb, C, p->qkv_out, QKV, 0);
        if (p->qkv_bias)
            for (int b = 0; b < B; b++) {
                float *q = p->qkv_out + (size_t)b * QKV;
                const float *bias = p->qkv_bias[l];
                for (int i = 0; i < QKV; i++) q[i] += bias[i];
            }
        if (p->q_norm)   /* per head, queries then keys (rms_norm reads a row whole before writing it) */
            for (int b = 0; b < B; b++) {
                float *q = p->qkv_out + (size_t)b * QKV;
                for (int h = 0; h < H + Hkv; h++)
                    rms_norm(q + h * D, q + h * D, h < H ? p->q_norm[l] : p->k_norm[l], p->norm_type, D, p->eps);
            }
        const int mode = p->layer_mode ? p->layer_mode[l] : p->mode, li = p->layer_index ? p->layer_index[l] : l;
        if (cos && (mode == MODE_SOFTMAX || p->linear_rope))
            for (int b = 0; b < B; b++) {
                float *q = p->qkv_out + (size_t)b * QKV;
                const float *cb = cos + (size_t)b * rope_stride, *sb = sin + (size_t)b * rope_stride;
                for (int h = 0; h < H + Hkv; h++) rotate(q + h * D, cb, sb, D);
            }
        if (mode == MODE_SOFTMAX) softmax_attention(p, li, slot, slot_real);
        else if (p->R > 0) sparse_attention(p, li, l);
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
    layers(p, tokens, slot, cos, sin, rope_stride, slot_real, 0, p->L);
    for (int b = 0; b < p->B; b++) rms_norm(p->xb + (size_t)b * C, p->x + (size_t)b * C, p->norm, p->norm_type, C, p->eps);
    matmul(p, &p->head, p->xb, C, logits, p->V, 0);
}

/* A prompt block on a prefill plan (Bc > 0, seq >= 0, made for up to `rows_max` rows): tokens (n) of
 * sequence p->seq at slots slot..slot+n-1, every row on the pool like a batch (its keys and values
 * written before any row attends, each row to the keys up to its own slot). cos/sin: the rotary
 * rows of those positions, D apart. Layers [l0, l1) only (0, L: the whole block; the same block in
 * pieces, in order, computes the same bits: the residual stream waits in p->x between them). Writes
 * the last row's logits (V) after layer L - 1 unless logits is NULL. */
void gen_prefill_layers(Plan *p, int rows_max, int n, const int64_t *tokens, int slot, const float *cos,
                        const float *sin, const uint8_t *slot_real, float *logits, int l0, int l1) {
    if (!prompt_plan(p) || n < 1 || n > rows_max || l0 < 0 || l1 > p->L || l0 >= l1) return;
    const int C = p->C;
    pool_quiesce();   /* no late worker still reads this plan's row count */
    p->B = n;
    layers(p, tokens, slot, cos, sin, p->D, slot_real, l0, l1);
    if (logits && l1 == p->L) {
        float *last = p->xb + (size_t)(n - 1) * C;
        rms_norm(last, p->x + (size_t)(n - 1) * C, p->norm, p->norm_type, C, p->eps);
        pool_quiesce();
        p->B = 1;
        matmul(p, &p->head, last, C, logits, p->V, 0);
    }
    pool_quiesce();
    p->B = rows_max;
}

void gen_prefill_block(Plan *p, int rows_max, int n, const int64_t *tokens, int slot, const float *cos,
                       const float *sin, const uint8_t *slot_real, float *logits) {
    gen_prefill_layers(p, rows_max, n, tokens, slot, cos, sin, slot_real, logits, 0, p->L);
}
