/* MoE experts on CPU for the rows of one step: out[t] = sum_k w[t,k] * down_e(silu(gate_e x_t) * up_e x_t).
 *
 * One call per MoE layer does the sort by expert, the gathers, both projections and the weighted
 * combine. Why this beats the torch path at a few rows per expert: there each expert's projections
 * are skinny GEMMs (2-8 rows) that MKL streams well below memory speed, plus ~25 dispatches per
 * layer. Here each chosen expert's weights are read exactly once, in the order they lie in memory,
 * while the rows that chose it sit in L1:
 *
 *   weights as stored (kernel layout: column-major per expert)  =  W^T row-major, [K][N]
 *
 *        W^T[k]   --------------------------->   out[r][:] += x[r][k] * W^T[k][:]   for the rows r
 *        W^T[k+1] --------------------------->                                      of this expert
 *        ...      (one front-to-back pass over each expert's two matrices)
 *
 * The combine adds the experts' outputs in ascending expert order, as the torch reference's
 * index_add_ loop does.
 *
 * Return: 0, -1 for an expert id outside [0, E) (nothing read out of bounds), -2 out of memory.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "small_gemm.h"

/* x [T][H]; w_gate_up [E][H][2I] and w_down [E][I][H] (each expert's W^T, row-major: the kernel
 * layout of the [E, 2I, H] / [E, H, I] stacks); topk_w [T][K] fp32, topk_ids [T][K] int64;
 * out [T][H] is overwritten. */
int moe_experts_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t K,
                    const float *w_gate_up, const float *w_down, const float *topk_w, const int64_t *topk_ids,
                    float *out) {
    const int64_t R = T * K;
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    if (R == 0) return 0;
    for (int64_t i = 0; i < R; i++)
        if (topk_ids[i] < 0 || topk_ids[i] >= E) return -1;

    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)); /* counting sort: rows of expert e are */
    int64_t *order = malloc((size_t)R * sizeof(int64_t));    /* order[start[e] : start[e+1]]       */
    if (!start || !order) {
        free(start);
        free(order);
        return -2;
    }
    for (int64_t i = 0; i < R; i++) start[topk_ids[i] + 1]++;
    int64_t busiest = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1] > busiest) busiest = start[e + 1];
        start[e + 1] += start[e];
    }
    int64_t *fill = malloc((size_t)E * sizeof(int64_t));
    /* per expert: its rows' x transposed [H][m], gate_up [m][2I], hidden transposed [I][m], y [m][H] */
    float *work = malloc((size_t)(busiest * (2 * H + 3 * I)) * sizeof(float));
    if (!fill || !work) {
        free(start);
        free(order);
        free(fill);
        free(work);
        return -2;
    }
    memcpy(fill, start, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < R; i++) order[fill[topk_ids[i]]++] = i; /* stable: token order per expert */

    float *xt = work, *gu = xt + busiest * H, *ht = gu + busiest * 2 * I, *y = ht + busiest * I;
    for (int64_t e = 0; e < E; e++) {
        const int64_t m = start[e + 1] - start[e];
        if (m == 0) continue;
        const int64_t *rows = order + start[e];
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + (rows[r] / K) * H;
            for (int64_t k = 0; k < H; k++) xt[k * m + r] = xr[k];
        }
        gemm_rows(m, 2 * I, H, xt, m, w_gate_up + e * H * 2 * I, gu);
        for (int64_t r = 0; r < m; r++) {
            const float *g = gu + r * 2 * I, *u = g + I;
            for (int64_t i = 0; i < I; i++) ht[i * m + r] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        gemm_rows(m, H, I, ht, m, w_down + e * I * H, y);
        for (int64_t r = 0; r < m; r++) { /* scale, then add: two roundings like torch's y * w, index_add_ */
            const float w = topk_w[rows[r]];
            float *yr = y + r * H, *o = out + (rows[r] / K) * H;
            for (int64_t n = 0; n < H; n++) yr[n] *= w;
            for (int64_t n = 0; n < H; n++) o[n] += yr[n];
        }
    }
    free(start);
    free(order);
    free(fill);
    free(work);
    return 0;
}

/* best[0..K) = the K largest of v[0..n) (masked entries -INFINITY never chosen), largest first, the
 * lower index first among equal values. Returns 1 when the choice is ambiguous: the K-th value equals
 * an unchosen one (torch's topk breaks such ties its own way; the caller then routes in torch). */
static int top_k(const float *v, int64_t n, int64_t K, int64_t *best) {
    for (int64_t j = 0; j < K; j++) {
        int64_t arg = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= best[i] == e;
            if (!taken && (arg < 0 || v[e] > v[arg])) arg = e;
        }
        best[j] = arg;
    }
    const float kth = v[best[K - 1]];
    for (int64_t e = 0; e < n; e++) {
        int taken = 0;
        for (int64_t i = 0; i < K; i++) taken |= best[i] == e;
        if (!taken && v[e] == kth) return 1;
    }
    return 0;
}

/* The router of route_ref (kernels/moe_ref.py) for the rows x [T][H], then the experts as in
 * moe_experts_f32, in one call: scores = sigmoid(x W_g^T) (W_g [E][H] row-major); top-K of scores +
 * bias (bias NULL: none), inside the best topk_group of n_group groups (group score: the sum of its
 * two best) when n_group > 1; weights = the chosen unbiased scores, divided by their sum + 1e-20
 * when renorm, times scaling. topk_w [T][K] / topk_ids [T][K] receive the choice. residual [T][H]
 * (NULL: none) is added last, out = residual + experts, as the decoder layer's x + mlp(h) rounds.
 * Return: 0; 1 when a choice is ambiguous (a tie at the K-th place or between groups: nothing
 * computed, the caller routes in torch); -2 out of memory. */
int moe_route_experts_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t K, const float *w_g,
                          const float *bias, int64_t n_group, int64_t topk_group, int renorm, float scaling,
                          const float *w_gate_up, const float *w_down, float *topk_w, int64_t *topk_ids,
                          const float *residual, float *out) {
    float *score = malloc((size_t)(3 * E) * sizeof(float)), *choice = score + E, *group = choice + E;
    int64_t *keep = malloc((size_t)(n_group > K ? n_group : K) * sizeof(int64_t));
    if (!score || !keep) {
        free(score);
        free(keep);
        return -2;
    }
    int ambiguous = 0;
    const int64_t per_group = E / n_group;
    for (int64_t t = 0; t < T && !ambiguous; t++) {
        const float *xr = x + t * H;
        for (int64_t e = 0; e < E; e++) {
            const float *wr = w_g + e * H;
            float lanes[16] = {0}, dot = 0.0f;
            int64_t k = 0;
            for (; k + 16 <= H; k += 16)
                for (int l = 0; l < 16; l++) lanes[l] += xr[k + l] * wr[k + l];
            for (; k < H; k++) dot += xr[k] * wr[k];
            for (int l = 0; l < 16; l++) dot += lanes[l];
            score[e] = 1.0f / (1.0f + expf(-dot));
            choice[e] = bias ? score[e] + bias[e] : score[e];
        }
        if (n_group > 1) {
            for (int64_t g = 0; g < n_group; g++) {
                int64_t two[2];
                const int64_t m = per_group < 2 ? per_group : 2;
                top_k(choice + g * per_group, per_group, m, two); /* a tie inside a group sums the same */
                group[g] = choice[g * per_group + two[0]] + (m == 2 ? choice[g * per_group + two[1]] : 0.0f);
            }
            ambiguous |= top_k(group, n_group, topk_group, keep);
            for (int64_t g = 0; g < n_group; g++) {
                int kept = 0;
                for (int64_t i = 0; i < topk_group; i++) kept |= keep[i] == g;
                if (!kept)
                    for (int64_t e = g * per_group; e < (g + 1) * per_group; e++) choice[e] = -INFINITY;
            }
        }
        int64_t *ids = topk_ids + t * K;
        ambiguous |= top_k(choice, E, K, ids);
        float *w = topk_w + t * K, sum = 0.0f;
        for (int64_t j = 0; j < K; j++) sum += (w[j] = score[ids[j]]);
        for (int64_t j = 0; j < K; j++) {
            if (renorm) w[j] = w[j] / (sum + 1e-20f);
            if (scaling != 1.0f) w[j] *= scaling;
        }
    }
    free(score);
    free(keep);
    if (ambiguous) return 1;
    const int rc = moe_experts_f32(x, T, H, I, E, K, w_gate_up, w_down, topk_w, topk_ids, out);
    if (rc == 0 && residual)
        for (int64_t i = 0; i < T * H; i++) out[i] = residual[i] + out[i];
    return rc;
}
