/* The k greedy draft steps of an MTP layer (mode "first": layer 0 every step) for B requests in one
 * call: llm_core/engine/speculative/fused_draft.py runs the same steps as ~20 torch dispatches each,
 * and at batch 1 those dispatches are the whole cost (docs/speculative.md, "What a batch-1 step
 * costs"). Weights arrive folded once per weight version (mtp_draft.py), in kernel layout W^T
 * [in][out] row-major (small_gemm.h):
 *
 *   gather:  k_buf[b][g][W - 1 - (c_b - p)] = k_cache[slot of p][g] for cached positions p < c_b (page tables)
 *   step s:  x   = T[d_s] + rms(h) W_h             (token table T = eh_proj_e enorm(embed), hnorm in W_h)
 *            qkv = (rms(x) norm_in) W_qkv            (q scale and value scale folded)
 *            q, k <- NeoX RoPE at position c_b + s  (the layer's cos / signed-sin tables)
 *            k, v -> k_buf / v_buf column W - 1 + s
 *            o   = softmax over columns max(s, first_b) .. W - 1 + s (+ the head's sink logit) of q.k, times v
 *            x  += o W_o ; x += down(silu(gate) * up) of (rms(x) norm_mlp)
 *            h   = rms(x) norm_final ; d_{s+1} = argmax(h lm_head^T)  (first max on ties)
 *
 * The window buffers (k_buf / v_buf [B][Hkv][W - 1 + K][D]) belong to the caller: one query per
 * request and head reads its window there; nothing is written into the pool (the extend after the
 * verify rewrites those positions' MTP KV anyway, fused_draft.py "KV").
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_ops.h"
#include "small_gemm.h"

/* one query q [D] against keys / values at columns a .. e of one head's window; sink: an extra
 * logit in the denominator only (NULL: none); o [Dv] is overwritten; scores: scratch */
static void attend(const float *q, const float *keys, const float *vals, int64_t a, int64_t e, int64_t D,
                   int64_t Dv, const float *sink, float *scores, float *o) {
    float top = sink ? *sink : -INFINITY;
    for (int64_t i = a; i <= e; i++) {
        const float *kr = keys + i * D;
        float dot = 0.0f;
        for (int64_t j = 0; j < D; j++) dot += q[j] * kr[j];
        scores[i] = dot;
        if (dot > top) top = dot;
    }
    float sum = sink ? expf(*sink - top) : 0.0f;
    for (int64_t i = a; i <= e; i++) sum += scores[i] = expf(scores[i] - top);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < Dv; j++) o[j] = 0.0f;
    for (int64_t i = a; i <= e; i++) {
        const float p = scores[i] * inv, *vr = vals + i * Dv;
        for (int64_t j = 0; j < Dv; j++) o[j] += p * vr[j];
    }
}

static inline int64_t most(int64_t a, int64_t b) { return a > b ? a : b; }

typedef struct {
    int64_t B, K, H, Hq, Hkv, D, Dv, I, V, W, R, rows; /* rows: window buffer columns (>= W - 1 + K) */
    float eps;
} DraftShape;

typedef struct {
    const float *table, *w_h, *norm_in, *w_qkv, *w_o, *norm_mlp, *w_gu, *w_down, *norm_final, *lm_head;
    const float *sinks; /* [Hq] or NULL */
} DraftWeights;

/* shape: see DraftShape. w: folded weights (table [V][H], w_h [H][H], w_qkv [H][N], w_o [Hq Dv][H],
 * w_gu [H][2I] (gate columns, then up), w_down [I][H], lm_head [H][V]; norms [H]). h_prev [B][H]: the
 * final-normed hidden state before each request's pending token tokens[b] at positions[b] = c_b;
 * cos / ssin: rows of ld floats (the first R used) for positions 0 .. P - 1. cached[b]: how many of
 * positions c_b - W + 1 .. c_b - 1 exist; pages + page_off[b]: request b's SWA pages from its page
 * index page0[b] on (npages[b] of them, < 0: released), page_size slots each, into k_cache
 * [S][Hkv][D] / v_cache [S][Hkv][Dv]. k_buf / v_buf [B][Hkv][rows][D or Dv]; out [K][B] draft tokens.
 * Return 0; -1 a token, position or slot out of range, -3 a needed page released (both checked
 * before anything is read through them); -2 out of memory. */
int mtp_draft_f32(const DraftShape *shape, const DraftWeights *w, const float *h_prev, const int64_t *tokens,
                  const int64_t *positions, const float *cos, const float *ssin, int64_t ld, int64_t P,
                  const int64_t *cached, const int64_t *pages, const int64_t *page_off, const int64_t *page0,
                  const int64_t *npages, int64_t page_size, const float *k_cache, const float *v_cache, int64_t S,
                  float *k_buf, float *v_buf, int64_t *out) {
    const int64_t B = shape->B, K = shape->K, H = shape->H, Hq = shape->Hq, Hkv = shape->Hkv, D = shape->D,
                  Dv = shape->Dv, I = shape->I, V = shape->V, W = shape->W, R = shape->R, rows = shape->rows;
    const float eps = shape->eps;
    const int64_t group = Hq / Hkv, qk = (Hq + Hkv) * D, N = qk + Hkv * Dv, A = Hq * Dv;
    if (R > ld || rows < W - 1 + K || page_size < 1) return -1;
    for (int64_t b = 0; b < B; b++) { /* every index checked before anything is read through it */
        if (tokens[b] < 0 || tokens[b] >= V || positions[b] < 0 || positions[b] + K > P) return -1;
        if (cached[b] < 0 || cached[b] > W - 1 || cached[b] > positions[b]) return -1;
        for (int64_t p = positions[b] - cached[b]; p < positions[b]; p++) {
            const int64_t j = p / page_size - page0[b];
            if (j < 0 || j >= npages[b]) return -1;
            const int64_t page = pages[page_off[b] + j];
            if (page < 0) return -3;
            if (page * page_size + p % page_size >= S) return -1;
        }
    }
    if (B == 0 || K == 0) return 0;
    /* the window's cached columns, head-major, right-aligned: column W - 1 - (c - p) holds position p */
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = positions[b] - cached[b]; p < positions[b]; p++) {
            const int64_t slot = pages[page_off[b] + p / page_size - page0[b]] * page_size + p % page_size;
            const int64_t i = W - 1 - (positions[b] - p);
            for (int64_t g = 0; g < Hkv; g++) {
                memcpy(k_buf + ((b * Hkv + g) * rows + i) * D, k_cache + (slot * Hkv + g) * D,
                       (size_t)D * sizeof(float));
                memcpy(v_buf + ((b * Hkv + g) * rows + i) * Dv, v_cache + (slot * Hkv + g) * Dv,
                       (size_t)Dv * sizeof(float));
            }
        }
    const int64_t widest = most(most(H, N), most(2 * I, V)), inner = most(most(H, A), I);
    /* x [B][H] residual; c [B][widest] a GEMM's output; t [inner][B] a GEMM's transposed input;
     * o [B][A]; scores [rows] */
    float *x = malloc((size_t)(B * H + B * widest + inner * B + B * A + rows) * sizeof(float));
    if (!x) return -2;
    float *c = x + B * H, *t = c + B * widest, *o = t + inner * B, *scores = o + B * A;
    int64_t *cur = out; /* this step's input tokens: tokens, then the previous step's row of out */
    for (int64_t b = 0; b < B; b++) rms_row(h_prev + b * H, H, NULL, eps, t + b, B);
    for (int64_t s = 0; s < K; s++) {
        const int64_t *ids = s ? cur : tokens, col = W - 1 + s;
        gemm_rows(B, H, H, t, B, w->w_h, c); /* rms(h) W_h */
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < H; j++) x[b * H + j] = w->table[ids[b] * H + j] + c[b * H + j];
        for (int64_t b = 0; b < B; b++) rms_row(x + b * H, H, w->norm_in, eps, t + b, B);
        gemm_rows(B, N, H, t, B, w->w_qkv, c);
        for (int64_t b = 0; b < B; b++) {
            float *row = c + b * N;
            const int64_t p = positions[b] + s;
            if (R > 0)
                for (int64_t h = 0; h < Hq + Hkv; h++) rope_head(row + h * D, R, cos + p * ld, ssin + p * ld);
            for (int64_t g = 0; g < Hkv; g++) {
                float *keys = k_buf + (b * Hkv + g) * rows * D, *vals = v_buf + (b * Hkv + g) * rows * Dv;
                memcpy(keys + col * D, row + (Hq + g) * D, (size_t)D * sizeof(float));
                memcpy(vals + col * Dv, row + qk + g * Dv, (size_t)Dv * sizeof(float));
                /* the query at c + s sees columns s .. W - 1 + s, those holding a key of request b */
                const int64_t first = W - 1 - cached[b], a = s > first ? s : first;
                for (int64_t i = 0; i < group; i++) {
                    const int64_t hd = g * group + i;
                    attend(row + hd * D, keys, vals, a, col, D, Dv, w->sinks ? w->sinks + hd : NULL, scores,
                           o + b * A + hd * Dv);
                }
            }
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < A; j++) t[j * B + b] = o[b * A + j];
        gemm_rows(B, H, A, t, B, w->w_o, c);
        for (int64_t i = 0; i < B * H; i++) x[i] += c[i];
        for (int64_t b = 0; b < B; b++) rms_row(x + b * H, H, w->norm_mlp, eps, t + b, B);
        gemm_rows(B, 2 * I, H, t, B, w->w_gu, c);
        for (int64_t b = 0; b < B; b++) {
            float *g = c + b * 2 * I; /* silu(gate) * up over the gate half, then transposed */
            silu_mul_row(g, g + I, I, g);
            for (int64_t i = 0; i < I; i++) t[i * B + b] = g[i];
        }
        gemm_rows(B, H, I, t, B, w->w_down, c);
        for (int64_t i = 0; i < B * H; i++) x[i] += c[i];
        for (int64_t b = 0; b < B; b++) rms_row(x + b * H, H, w->norm_final, eps, t + b, B); /* h, transposed */
        gemm_rows(B, V, H, t, B, w->lm_head, c);
        cur = out + s * B;
        for (int64_t b = 0; b < B; b++) {
            const float *logits = c + b * V;
            int64_t best = 0;
            for (int64_t v = 1; v < V; v++)
                if (logits[v] > logits[best]) best = v; /* strict: the first max wins, as torch.argmax */
            cur[b] = best;
        }
        /* the next step's rms(h) (hnorm folded into W_h): h is the final-normed x, normed once more
         * (c is free: the logits are read) */
        if (s + 1 < K)
            for (int64_t b = 0; b < B; b++) {
                rms_row(x + b * H, H, w->norm_final, eps, c, 1);
                rms_row(c, H, NULL, eps, t + b, B);
            }
    }
    free(x);
    return 0;
}
