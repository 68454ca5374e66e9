/* The glue of one decoder layer around its attention, for the few rows of a decode step: two calls
 * per layer instead of ~20 torch dispatches.
 *
 * attention_front_f32 (before the attention kernel, paged_decode.c):
 *   h = RMSNorm(x) * w_norm         (skipped when no norm weight is given)
 *   [q | k | v] = h W_qkv^T         (W_qkv in kernel layout: W^T [H][N] row-major)
 *   q, k <- NeoX RoPE over the first R dims of each head (the step's cos / signed-sin tables)
 *   v <- value_scale * v
 *   k_cache[slot[t]] = k[t], v_cache[slot[t]] = v[t]   (slot < 0: padding, not written)
 *
 * attention_out_f32 (after it):
 *   x_out = x + attn W_o^T          (the residual add)
 *   h     = RMSNorm(x_out) * w_norm (the post-attention norm: the MLP's input)
 *
 * dense_mlp_f32 (a dense layer's MLP; MoE layers: moe_experts.c):
 *   out = residual + down(silu(gate h) * up h)
 *
 * Why: in torch the front alone is ~15 dispatches per layer (norm, linear, the RoPE's flip / mul /
 * add, two index_copy_) at ~10 us each, for arithmetic of tens of microseconds (hidden 256, 32 rows:
 * 3 M multiply-adds). Here the projections run as register tiles (small_gemm.h, as fast as MKL at
 * these shapes) and the rest runs on the rows while they are in cache.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_ops.h"
#include "small_gemm.h"
#include "team.h"

/* out[k * step] = x[k] * inv_rms(x) * w[k] for k < H (w NULL: x[k], no norm); step 1 writes a row,
 * step T a column of a transposed [H][T] block (the GEMM's input). */
static void norm_row(const float *x, int64_t H, const float *w, float eps, float *out, int64_t step) {
    if (w) {
        rms_row(x, H, w, eps, out, step);
        return;
    }
    for (int64_t k = 0; k < H; k++) out[k * step] = x[k];
}

/* x [T][H]; norm_w [H] or NULL; w_t [H][N] with N = (Hq + Hkv) * D + Hkv * Dv; cos / ssin [T][R];
 * k_cache [num_slots][Hkv][D], v_cache [num_slots][Hkv][Dv]; slots [T]; qkv [T][N] is overwritten.
 * Return 0; -1 when a slot lies at or past num_slots (checked before anything is written); -2 out
 * of memory. */
int attention_front_f32(const float *x, int64_t T, int64_t H, const float *norm_w, float eps, const float *w_t,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t R, const float *cos,
                        const float *ssin, float value_scale, float *k_cache, float *v_cache, int64_t num_slots,
                        const int64_t *slots, float *qkv) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    if (T == 0) return 0; /* nothing to do (and malloc(0) may return NULL) */
    const int64_t qk = (Hq + Hkv) * D, kv = Hkv * D, vv = Hkv * Dv, N = qk + vv;
    float *xt = malloc((size_t)(T * H) * sizeof(float));
    if (!xt) return -2;
    for (int64_t t = 0; t < T; t++) norm_row(x + t * H, H, norm_w, eps, xt + t, T);
    gemm_rows(T, N, H, xt, T, w_t, qkv);
    free(xt);
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * N;
        if (R > 0)
            for (int64_t h = 0; h < Hq + Hkv; h++) rope_head(row + h * D, R, cos + t * R, ssin + t * R);
        if (value_scale != 1.0f) /* x * 1.0 == x: the torch path skips it too */
            for (int64_t j = qk; j < N; j++) row[j] *= value_scale;
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * kv, row + Hq * D, (size_t)kv * sizeof(float));
        memcpy(v_cache + slots[t] * vv, row + qk, (size_t)vv * sizeof(float));
    }
    return 0;
}

/* attn [T][A], x [T][H], wo_t [A][H], norm_w [H]; x_out and h [T][H] are overwritten.
 * Return 0, -2 out of memory. */
int attention_out_f32(const float *attn, int64_t T, int64_t A, const float *wo_t, const float *x, int64_t H,
                      const float *norm_w, float eps, float *x_out, float *h) {
    if (T == 0) return 0;
    float *at = malloc((size_t)(T * A) * sizeof(float));
    if (!at) return -2;
    for (int64_t t = 0; t < T; t++) norm_row(attn + t * A, A, NULL, 0.0f, at + t, T); /* transpose only */
    gemm_rows(T, H, A, at, T, wo_t, x_out);
    free(at);
    for (int64_t i = 0; i < T * H; i++) x_out[i] = x[i] + x_out[i]; /* x + (attn W_o^T), as torch adds */
    for (int64_t t = 0; t < T; t++) norm_row(x_out + t * H, H, norm_w, eps, h + t * H, 1);
    return 0;
}

/* h [T][H]; wg_t, wu_t [H][I] and wd_t [I][H] (kernel layout); residual [T][H] or NULL; out [T][H]
 * is overwritten. silu(g) = g / (1 + e^-g), as torch computes it (row_ops.h silu_mul_row). Return 0, -2
 * out of memory. */
int dense_mlp_f32(const float *h, int64_t T, int64_t H, int64_t I, const float *wg_t, const float *wu_t,
                  const float *wd_t, const float *residual, float *out) {
    if (T == 0) return 0;
    float *ht = malloc((size_t)(T * (H + 3 * I)) * sizeof(float));
    if (!ht) return -2;
    float *g = ht + T * H, *u = g + T * I, *st = u + T * I;
    for (int64_t t = 0; t < T; t++) norm_row(h + t * H, H, NULL, 0.0f, ht + t, T); /* transpose only */
    gemm_rows(T, I, H, ht, T, wg_t, g);
    gemm_rows(T, I, H, ht, T, wu_t, u);
    for (int64_t t = 0; t < T; t++) { /* silu(gate) * up in place, then transposed */
        silu_mul_row(g + t * I, u + t * I, I, g + t * I);
        for (int64_t i = 0; i < I; i++) st[i * T + t] = g[t * I + i];
    }
    gemm_rows(T, H, I, st, T, wd_t, out);
    free(ht);
    if (residual)
        for (int64_t i = 0; i < T * H; i++) out[i] = residual[i] + out[i];
    return 0;
}

/* ---- a long prefill step's glue around MKL's projections ------------------------------------------
 * Past MAX_ROWS rows the projections are compute (MKL's GEMMs, called from torch); what is left between
 * them is per-row arithmetic that torch spreads over ~10 dispatches per layer on strided views (RoPE's
 * roll / mul / add, the value scale, two index_copy_, the residual add, the norm's pow / sum / div /
 * mul). These two calls do it in one pass over the rows each. */

/* The rows [lo, hi) of rope_store_f32 (slots already checked). */
static void rope_store_rows(float *qkv, int64_t lo, int64_t hi, int64_t ld, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t Dv, int64_t R, const float *cos, const float *ssin, float value_scale,
                            float *k_cache, float *v_cache, const int64_t *slots) {
    const int64_t qk = (Hq + Hkv) * D, kv = Hkv * D, vv = Hkv * Dv, N = qk + vv;
    for (int64_t t = lo; t < hi; t++) {
        float *row = qkv + t * ld;
        if (R > 0)
            for (int64_t h = 0; h < Hq + Hkv; h++) rope_head(row + h * D, R, cos + t * R, ssin + t * R);
        if (value_scale != 1.0f)
            for (int64_t j = qk; j < N; j++) row[j] *= value_scale;
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * kv, row + Hq * D, (size_t)kv * sizeof(float));
        memcpy(v_cache + slots[t] * vv, row + qk, (size_t)vv * sizeof(float));
    }
}

/* qkv [T][N] (row stride ld >= N) from the QKV projection, N = (Hq + Hkv) * D + Hkv * Dv: RoPE on the q
 * and k heads, value scale on v, in place; k and v stored at slots (< 0: padding, not written). Return 0;
 * -1 when a slot lies at or past num_slots (checked before anything is written). */
int rope_store_f32(float *qkv, int64_t T, int64_t ld, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t R,
                   const float *cos, const float *ssin, float value_scale, float *k_cache, float *v_cache,
                   int64_t num_slots, const int64_t *slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    if (!split_on_team(T)) {
        rope_store_rows(qkv, 0, T, ld, Hq, Hkv, D, Dv, R, cos, ssin, value_scale, k_cache, v_cache, slots);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        rope_store_rows(qkv, T * me / nt, T * (me + 1) / nt, ld, Hq, Hkv, D, Dv, R, cos, ssin, value_scale, k_cache,
                        v_cache, slots);
    }
#endif
    return 0;
}

/* The rows [lo, hi) of add_rms_norm_f32. */
static void add_rms_rows(const float *x, const float *delta, int64_t lo, int64_t hi, int64_t H, const float *norm_w,
                         float eps, float *sum_out, float *h) {
    for (int64_t t = lo; t < hi; t++) {
        const float *row = x + t * H;
        if (delta) {
            float *s = sum_out + t * H;
            for (int64_t k = 0; k < H; k++) s[k] = row[k] + delta[t * H + k];
            row = s;
        }
        rms_row(row, H, norm_w, eps, h + t * H, 1);
    }
}

/* x, delta [T][H] (delta NULL: no add); sum_out [T][H] = x + delta (unused without delta), h [T][H] =
 * RMSNorm(x + delta) * norm_w. */
void add_rms_norm_f32(const float *x, const float *delta, int64_t T, int64_t H, const float *norm_w, float eps,
                      float *sum_out, float *h) {
    if (!split_on_team(T)) {
        add_rms_rows(x, delta, 0, T, H, norm_w, eps, sum_out, h);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        add_rms_rows(x, delta, T * me / nt, T * (me + 1) / nt, H, norm_w, eps, sum_out, h);
    }
#endif
}
