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

#include "row_ops.h"
#include "small_gemm.h"
#include "team.h"

/* Rows of one expert per work item of a split call: small enough that 2 threads balance over a few
 * experts, a multiple of the register tile's 6 rows. */
#define CHUNK_ROWS 48
/* The split call keeps every (token, k) row's output until the combine: at most this many bytes of
 * them, else the call stays serial (whose scratch is one work item's rows). */
#define SPLIT_MAX_BYTES ((int64_t)64 << 20)

/* One expert's rows rows[0..m) (indices into the [T][K] choice) -> y [m][H], each row scaled by its
 * weight: y = w * down(silu(gate x) * up x). Scratch xt [H][m], gu [m][2I], ht [I][m]. A row's result
 * does not depend on the rows beside it (small_gemm.h), so any split of an expert's rows gives the
 * same bits. */
static void expert_rows(const float *x, const int64_t *rows, int64_t m, int64_t H, int64_t I, int64_t K,
                        const float *w_gate_up, const float *w_down, const float *topk_w, float *xt, float *gu,
                        float *ht, float *y) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + (rows[r] / K) * H;
        for (int64_t k = 0; k < H; k++) xt[k * m + r] = xr[k];
    }
    gemm_rows(m, 2 * I, H, xt, m, w_gate_up, gu);
    for (int64_t r = 0; r < m; r++) { /* silu(gate) * up over the gate half, then transposed */
        float *g = gu + r * 2 * I;
        silu_mul_row(g, g + I, I, g);
        for (int64_t i = 0; i < I; i++) ht[i * m + r] = g[i];
    }
    gemm_rows(m, H, I, ht, m, w_down, y);
    for (int64_t r = 0; r < m; r++) { /* scale here, add in the combine: two roundings like torch's y * w, index_add_ */
        const float w = topk_w[rows[r]];
        float *yr = y + r * H;
        for (int64_t n = 0; n < H; n++) yr[n] *= w;
    }
}

/* The split call: work items of up to CHUNK_ROWS rows of one expert, taken by the team's threads as
 * they free up, each writing its rows' scaled outputs y at their sorted positions; then the tokens,
 * split among the team, each add their K rows in ascending expert order (k ascending within an
 * expert) -- the order of the serial loop, so out is the serial call's bit for bit. */
static int experts_split(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t K,
                         const float *w_gate_up, const float *w_down, const float *topk_w, const int64_t *topk_ids,
                         const int64_t *start, const int64_t *order, float *out) {
    const int64_t R = T * K;
    int64_t items = 0;
    for (int64_t e = 0; e < E; e++) items += (start[e + 1] - start[e] + CHUNK_ROWS - 1) / CHUNK_ROWS;
    float *y = malloc((size_t)(R * H) * sizeof(float));
    int64_t *item_e = malloc((size_t)items * 2 * sizeof(int64_t)), *pos = malloc((size_t)R * sizeof(int64_t));
    if (!y || !item_e || !pos) {
        free(y);
        free(item_e);
        free(pos);
        return -2;
    }
    int64_t *item_r = item_e + items;
    for (int64_t e = 0, j = 0; e < E; e++)
        for (int64_t r = start[e]; r < start[e + 1]; r += CHUNK_ROWS, j++) item_e[j] = e, item_r[j] = r;
    for (int64_t p = 0; p < R; p++) pos[order[p]] = p;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
        float *ws = malloc((size_t)(CHUNK_ROWS * (H + 3 * I)) * sizeof(float));
        if (!ws) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t j = 0; j < items; j++) {
            if (!ws) continue;
            const int64_t e = item_e[j], p = item_r[j];
            const int64_t m = start[e + 1] - p < CHUNK_ROWS ? start[e + 1] - p : CHUNK_ROWS;
            expert_rows(x, order + p, m, H, I, K, w_gate_up + e * H * 2 * I, w_down + e * I * H, topk_w, ws,
                        ws + CHUNK_ROWS * H, ws + CHUNK_ROWS * (H + 2 * I), y + p * H);
        }
        free(ws);
        if (!failed) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t t = 0; t < T; t++) {
                const int64_t *ids = topk_ids + t * K;
                float *o = out + t * H;
                /* the token's rows in ascending (expert, k): selection by the smallest pair not yet added */
                for (int64_t done = 0, last_e = -1, last_k = -1; done < K; done++) {
                    int64_t best = -1;
                    for (int64_t k = 0; k < K; k++) {
                        const int after = ids[k] > last_e || (ids[k] == last_e && k > last_k);
                        if (after && (best < 0 || ids[k] < ids[best])) best = k;
                    }
                    const float *yr = y + pos[t * K + best] * H;
                    for (int64_t n = 0; n < H; n++) o[n] += yr[n];
                    last_e = ids[best], last_k = best;
                }
            }
        }
    }
    free(y);
    free(item_e);
    free(pos);
    return failed ? -2 : 0;
}

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
    int64_t *fill = malloc((size_t)E * sizeof(int64_t));
    if (!start || !order || !fill) {
        free(start);
        free(order);
        free(fill);
        return -2;
    }
    for (int64_t i = 0; i < R; i++) start[topk_ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < R; i++) order[fill[topk_ids[i]]++] = i; /* stable: token order per expert */
    free(fill);

    int rc = 0;
    if ((split_on_team(T) || split_work_on_team(R * 3 * I * H)) && R * H * (int64_t)sizeof(float) <= SPLIT_MAX_BYTES) {
        rc = experts_split(x, T, H, I, E, K, w_gate_up, w_down, topk_w, topk_ids, start, order, out);
    } else {
        /* one work item's scratch (as a split call's thread has): its rows' x transposed [H][m],
         * gate_up [m][2I], hidden transposed [I][m], y [m][H] -- bounded whatever one expert gets.
         * Items in expert order, rows ascending: the same order of additions into out as the split
         * call's combine, and a row's result does not depend on which rows share its item. */
        float *ws = malloc((size_t)(CHUNK_ROWS * (2 * H + 3 * I)) * sizeof(float));
        if (!ws) rc = -2;
        float *y = ws + CHUNK_ROWS * (H + 3 * I);
        for (int64_t e = 0; e < E && ws; e++)
            for (int64_t p = start[e]; p < start[e + 1]; p += CHUNK_ROWS) {
                const int64_t m = start[e + 1] - p < CHUNK_ROWS ? start[e + 1] - p : CHUNK_ROWS;
                const int64_t *rows = order + p;
                expert_rows(x, rows, m, H, I, K, w_gate_up + e * H * 2 * I, w_down + e * I * H, topk_w, ws,
                            ws + CHUNK_ROWS * H, ws + CHUNK_ROWS * (H + 2 * I), y);
                for (int64_t r = 0; r < m; r++) {
                    const float *yr = y + r * H;
                    float *o = out + (rows[r] / K) * H;
                    for (int64_t n = 0; n < H; n++) o[n] += yr[n];
                }
            }
        free(ws);
    }
    free(start);
    free(order);
    return rc;
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

/* The router of moe_route_experts_f32 for the tokens [lo, hi): 0, 1 when a choice is ambiguous (it
 * stops there), -2 out of memory. */
static int route_rows(const float *x, int64_t lo, int64_t hi, int64_t H, int64_t E, int64_t K, const float *w_g,
                      const float *bias, int64_t n_group, int64_t topk_group, int renorm, float scaling,
                      float *topk_w, int64_t *topk_ids) {
    float *score = malloc((size_t)(3 * E) * sizeof(float)), *choice = score + E, *group = choice + E;
    int64_t *keep = malloc((size_t)(n_group > K ? n_group : K) * sizeof(int64_t));
    if (!score || !keep) {
        free(score);
        free(keep);
        return -2;
    }
    int ambiguous = 0;
    const int64_t per_group = E / n_group;
    for (int64_t t = lo; t < hi && !ambiguous; t++) {
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
    return ambiguous;
}

/* The router of route_ref (kernels/moe_ref.py) for the rows x [T][H], then the experts as in
 * moe_experts_f32, in one call: scores = sigmoid(x W_g^T) (W_g [E][H] row-major); top-K of scores +
 * bias (bias NULL: none), inside the best topk_group of n_group groups (group score: the sum of its
 * two best) when n_group > 1; weights = the chosen unbiased scores, divided by their sum + 1e-20
 * when renorm, times scaling. topk_w [T][K] / topk_ids [T][K] receive the choice. residual [T][H]
 * (NULL: none) is added last, out = residual + experts, as the decoder layer's x + mlp(h) rounds.
 * A call of many tokens on a wide thread routes them split among its team (each token on its own).
 * Return: 0; 1 when a choice is ambiguous (a tie at the K-th place or between groups: nothing
 * computed, the caller routes in torch); -2 out of memory. */
int moe_route_experts_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t K, const float *w_g,
                          const float *bias, int64_t n_group, int64_t topk_group, int renorm, float scaling,
                          const float *w_gate_up, const float *w_down, float *topk_w, int64_t *topk_ids,
                          const float *residual, float *out) {
    int ambiguous = 0, failed = 0;
    if (!split_on_team(T)) {
        const int got = route_rows(x, 0, T, H, E, K, w_g, bias, n_group, topk_group, renorm, scaling, topk_w, topk_ids);
        ambiguous = got == 1, failed = got == -2;
    } else {
#ifdef _OPENMP
#pragma omp parallel reduction(| : ambiguous, failed)
        {
            const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
            const int got = route_rows(x, T * me / nt, T * (me + 1) / nt, H, E, K, w_g, bias, n_group, topk_group,
                                       renorm, scaling, topk_w, topk_ids);
            ambiguous = got == 1, failed = got == -2;
        }
#endif
    }
    if (failed) return -2;
    if (ambiguous) return 1;
    const int rc = moe_experts_f32(x, T, H, I, E, K, w_gate_up, w_down, topk_w, topk_ids, out);
    if (rc == 0 && residual)
        for (int64_t i = 0; i < T * H; i++) out[i] = residual[i] + out[i];
    return rc;
}
