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

#ifndef WIDE
#define WIDE 1024 /* outputs at least this wide read 4 rows of W^T per pass, narrower ones 2 */
#endif

/* c[r][:] += a[k'][r] * b[k'][:] for k' = k, k+1 (pass4: to k+3), in that order, one multiply-add
 * each: those rows of b stream past once while all m rows of c take them in. */
static void pass2(int64_t m, int64_t n, int64_t k, const float *a, const float *b, float *c) {
    const float *b0 = b + k * n, *b1 = b0 + n;
    for (int64_t r = 0; r < m; r++) {
        const float x0 = a[k * m + r], x1 = a[(k + 1) * m + r];
        float *restrict cr = c + r * n;
        for (int64_t j = 0; j < n; j++) cr[j] = (cr[j] + x0 * b0[j]) + x1 * b1[j];
    }
}

static void pass4(int64_t m, int64_t n, int64_t k, const float *a, const float *b, float *c) {
    const float *b0 = b + k * n, *b1 = b0 + n, *b2 = b1 + n, *b3 = b2 + n;
    for (int64_t r = 0; r < m; r++) {
        const float x0 = a[k * m + r], x1 = a[(k + 1) * m + r], x2 = a[(k + 2) * m + r], x3 = a[(k + 3) * m + r];
        float *restrict cr = c + r * n;
        for (int64_t j = 0; j < n; j++) cr[j] = (((cr[j] + x0 * b0[j]) + x1 * b1[j]) + x2 * b2[j]) + x3 * b3[j];
    }
}

/* c [m][n] = a^T b for a few rows m: a given transposed [kdim][m] (the rows' k-th values side by
 * side), b [kdim][n] = W^T as stored. b is read once, front to back, 2 or 4 rows per pass; the m
 * rows of c stay in cache and the inner loop vectorises over n:
 *
 *     for k in 0, 2, 4, ...:   c[r][:] = (c[r][:] + a[k][r] * b[k][:]) + a[k+1][r] * b[k+1][:]
 *
 * Measured (one thread, weights from memory; benchmarks/moe_experts.py and a C harness): walking b
 * as one forward stream beat register tiles over 32-column stripes of 16-64 rows of b (demo model,
 * 32-row step: 0.53 vs 0.99 ms per layer): the stripe walk keeps 16+ streams open, the prefetchers
 * fall behind, and the tiles' arithmetic advantage is lost waiting on memory. Column blocks that keep
 * c in L1 for wide outputs were slower too (MiMo-V2.5's n = 4096: 1-8 KB runs per row of b instead
 * of 16 KB). Rows of b per pass: 2 for narrow outputs (demo n = 256: 4 rows 0.86 vs 0.53 ms), 4 for
 * wide ones (MiMo, one token: 38 vs 48 ms, 20 GB/s). Holding 64 columns of the two rows of b in
 * registers across all rows of c (instead of re-reading them from L1 per row) was faster with the
 * weights in cache (0.35 -> 0.27 ms) but slower from memory (0.68 -> 0.80-0.95 ms, with or without
 * software prefetch): the weights then arrive in bursts, not as a steady stream. The sum runs k ascending, one multiply-add per
 * k, whatever m is: a row's result does not depend on which rows share the call. */
static void gemm_small_m(int64_t m, int64_t n, int64_t kdim, const float *a, const float *b, float *c) {
    memset(c, 0, (size_t)(m * n) * sizeof(float));
    int64_t k = 0;
    if (n >= WIDE)
        for (; k + 4 <= kdim; k += 4) pass4(m, n, k, a, b, c);
    for (; k + 2 <= kdim; k += 2) pass2(m, n, k, a, b, c);
    for (; k < kdim; k++) {
        const float *bk = b + k * n;
        for (int64_t r = 0; r < m; r++) {
            const float xr = a[k * m + r];
            float *restrict cr = c + r * n;
            for (int64_t j = 0; j < n; j++) cr[j] += xr * bk[j];
        }
    }
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
        gemm_small_m(m, 2 * I, H, xt, w_gate_up + e * H * 2 * I, gu);
        for (int64_t r = 0; r < m; r++) {
            const float *g = gu + r * 2 * I, *u = g + I;
            for (int64_t i = 0; i < I; i++) ht[i * m + r] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        gemm_small_m(m, H, I, ht, w_down + e * I * H, y);
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
