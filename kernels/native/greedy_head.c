/* Greedy LM head: the argmax over the vocabulary of h W^T for a few rows, without writing the logits.
 *
 *   h   [m][K]         the final-normed hidden rows that sample (fp32)
 *   W^T [K][N]         the LM head in kernel layout (column-major W [N][K], kernels/ops.py)
 *   ids [m]            argmax_j (h W^T)[r][j], ties to the lowest j (torch.argmax's rule)
 *
 * Why: a greedy step with no logprobs needs only the winning id. The torch path writes the [m][N]
 * logits (1 MB at 32 rows of an 8k vocabulary), reads them back for argmax (~0.2 ms) and hands the
 * sampler a tensor it inspects row by row. Here each 64-column stripe of W^T streams past once while
 * a register tile of rows x 64 logits is summed, and the tile goes straight into a running
 * (max, first index) per row and lane:
 *
 *      stripe j0 .. j0+63 of W^T:  k = 0 .. K-1  ->  acc[r][v] (MR rows x 4 vectors, registers)
 *      lane update:    acc > best  ?  (best, idx) = (acc, j0 + 16 v + lane)  :  keep
 *      (columns go by in ascending order, so a lane keeps the first column holding its maximum)
 *      end:            best over lanes; among lanes equal to it, the lowest idx
 *
 * One or two rows (STREAM_ROWS) read W^T front to back instead (small_gemm.h's gemm_small_m) into a
 * scratch of their logits, scanned the same way. Each logit is the sum over k ascending of one
 * multiply-add each from zero in both paths (small_gemm.h's order), so a row's id does not depend on
 * the rows beside it. NaN never
 * wins a strict ">" comparison, so a NaN logit is reported instead (return 1): torch.argmax takes
 * the first NaN, and the caller computes that step's logits in torch.
 *
 * A build without AVX-512 computes the logits with small_gemm.h's gemm_rows (same order of sums, so
 * the same ids) and scans them (end of this file).
 *
 * Return: 0; 1 a logit was NaN (ids undefined); -2 out of memory.
 */

#include <stdint.h>
#include <stdlib.h>

/* bytes of W^T the stream of a row or two asks for ahead (small_gemm.h's default, 8 KB, suits its
 * 1 KB rows; the head's are 32 KB: one row from memory 0.52 ms at 8 KB, 0.46 ms at 128 KB) */
#define AHEAD (128 * 1024)
#include "small_gemm.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define PF_ROWS 8 /* rows of W^T ahead that the first row tile of a stripe asks for (into L2) */
#ifndef STREAM_ROWS
#define STREAM_ROWS 2 /* up to this many rows: W^T read front to back, the logits in a scratch row */
#endif

/* The running (max, first index) of each row's lanes, and whether a lane saw NaN. */
typedef struct {
    float *best;   /* [m][16] */
    int32_t *idx;  /* [m][16] */
    __mmask16 *nan; /* [m] */
} Running;

static inline void update_lane(const Running *s, int64_t r, __m512 x, __m512i cols, __mmask16 valid) {
    __m512 b = _mm512_loadu_ps(s->best + r * 16);
    __mmask16 win = _mm512_mask_cmp_ps_mask(valid, x, b, _CMP_GT_OQ);
    _mm512_storeu_ps(s->best + r * 16, _mm512_mask_blend_ps(win, b, x));
    __m512i i = _mm512_loadu_si512(s->idx + r * 16);
    _mm512_storeu_si512(s->idx + r * 16, _mm512_mask_blend_epi32(win, i, cols));
    s->nan[r] |= _mm512_mask_cmp_ps_mask(valid, x, x, _CMP_UNORD_Q);
}

/* The running state of rows r0 .. r0+mr-1 takes their logits of columns j0 .. j0+63 (logits [mr][64]:
 * a tile's accumulators, stored once into L1 after its k loop; updating from the registers in the tile
 * itself made the compiler keep every accumulator on the stack inside the k loop, 2x slower). */
static __attribute__((noinline)) void update_rows(const Running *s, int64_t r0, int mr, const float *logits,
                                                  int64_t j0, const __mmask16 valid[4]) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int v = 0; v < 4 && valid[v]; v++) {
        const __m512i cols = _mm512_add_epi32(lanes, _mm512_set1_epi32((int32_t)(j0 + 16 * v)));
        for (int r = 0; r < mr; r++) update_lane(s, r0 + r, _mm512_loadu_ps(logits + r * 64 + 16 * v), cols, valid[v]);
    }
}

/* One tile: MR rows (a transposed, a[k * lda + r]) x the 64 columns j0 .. j0+63 (``valid`` masks the
 * vectors of a short last stripe) -> logits [MR][64]; every bound a constant, so the MR x 4
 * accumulators stay in registers (MR = 6: 24 of the 32 vector registers). */
#define DEFINE_TILE(MR)                                                                                         \
    static void tile_##MR(int64_t kdim, const float *a, int64_t lda, const float *b, int64_t n, int64_t j0,      \
                          const __mmask16 valid[4], int64_t pf, const float *next, int64_t line0,               \
                          float *logits) {                                                                      \
        __m512 acc[MR][4] = {0};                                                                                \
        /* pf 0: the stripe is already in cache and the prefetches hit the rows being read */                   \
        const int64_t ahead = pf * n;                                                                           \
        const __mmask16 m0 = valid[0], m1 = valid[1], m2 = valid[2], m3 = valid[3];                             \
        for (int64_t k = 0; k < kdim; k++) {                                                                    \
            const float *bk = b + k * n + j0;                                                                   \
            for (int v = 0; v < 4; v++) __builtin_prefetch(bk + ahead + 16 * v, 0, 2);                         \
            next_stripe_line(next, line0 + k, n); /* the tiles after the first: the next stripe */              \
            const __m512 b0 = _mm512_maskz_loadu_ps(m0, bk), b1 = _mm512_maskz_loadu_ps(m1, bk + 16),            \
                         b2 = _mm512_maskz_loadu_ps(m2, bk + 32), b3 = _mm512_maskz_loadu_ps(m3, bk + 48);       \
            const float *ak = a + k * lda;                                                                      \
            for (int r = 0; r < MR; r++) {                                                                      \
                const __m512 ar = _mm512_set1_ps(ak[r]);                                                        \
                acc[r][0] = _mm512_fmadd_ps(ar, b0, acc[r][0]);                                                 \
                acc[r][1] = _mm512_fmadd_ps(ar, b1, acc[r][1]);                                                 \
                acc[r][2] = _mm512_fmadd_ps(ar, b2, acc[r][2]);                                                 \
                acc[r][3] = _mm512_fmadd_ps(ar, b3, acc[r][3]);                                                 \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < MR; r++)                                                                            \
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(logits + r * 64 + 16 * v, acc[r][v]);                  \
    }

DEFINE_TILE(6)
DEFINE_TILE(4)
DEFINE_TILE(2)
DEFINE_TILE(1)

/* which lanes of the 4 vectors of columns j0 .. j0+63 lie inside the vocabulary */
static void column_masks(int64_t n, int64_t j0, __mmask16 valid[4]) {
    for (int v = 0; v < 4; v++) {
        const int64_t left = n - j0 - 16 * v;
        valid[v] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
    }
}

/* Each row's id from its lanes (the maximum; among lanes holding it, the lowest column), then the
 * scratch freed (``a`` and the running state's arrays). Returns 1 when a row saw a NaN, else 0. */
static int finish(const Running *s, int64_t m, int64_t n, int64_t *ids, float *a) {
    int status = 0;
    for (int64_t r = 0; r < m; r++) {
        const float *best = s->best + r * 16;
        const int32_t *idx = s->idx + r * 16;
        if (s->nan[r]) status = 1;
        float top = best[0];
        for (int l = 1; l < 16; l++) top = best[l] > top ? best[l] : top;
        int64_t first = n;
        for (int l = 0; l < 16; l++)
            if (best[l] == top && idx[l] < first) first = idx[l];
        ids[r] = first < n ? first : 0;
    }
    free(a);
    free(s->best);
    free(s->idx);
    free(s->nan);
    return status;
}

/* the most rows for which this build beats MKL's GEMM + torch.argmax: every call it takes (the
 * wrapper's MAX_ROWS; 32 rows 1.70 vs 2.68 ms) */
int greedy_head_fast_rows(void) { return 1 << 30; }

int lm_head_argmax_f32(const float *h, int64_t m, int64_t kdim, const float *wt, int64_t n, int64_t *ids) {
    if (m <= 0) return 0;
    float *a = malloc((size_t)(kdim * m) * sizeof(float)); /* h transposed: a tile's k-th values side by side */
    float *best = malloc((size_t)(m * 16) * sizeof(float));
    int32_t *idx = malloc((size_t)(m * 16) * sizeof(int32_t));
    __mmask16 *nan = calloc((size_t)m, sizeof(__mmask16));
    if (!a || !best || !idx || !nan) {
        free(a);
        free(best);
        free(idx);
        free(nan);
        return -2;
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t k = 0; k < kdim; k++) a[k * m + r] = h[r * kdim + k];
    /* -inf with index 0: a row whose logits are all -inf gets id 0, as torch.argmax gives */
    for (int64_t e = 0; e < m * 16; e++) {
        best[e] = -__builtin_inff();
        idx[e] = 0;
    }
    const Running s = {best, idx, nan};
    if (m <= STREAM_ROWS) {
        /* A row or two: the stripes' walk (rows of W^T 4 * n bytes apart, a new page each) waits on
         * memory with too little arithmetic to hide it (2 rows, 8k x 256 head: 0.87 ms, streamed 0.55-0.71).
         * gemm_small_m streams W^T front to back instead, its sums in the same order as the tiles'
         * (k ascending, one multiply-add each, from zero: the same bits), into [m][n] logits that
         * stay in L1 / L2 (32 KB per row of an 8k vocabulary), then scanned 64 columns at a time. */
        float *c = malloc((size_t)(m * n) * sizeof(float));
        if (!c) {
            free(a);
            free(best);
            free(idx);
            free(nan);
            return -2;
        }
        gemm_small_m(m, n, kdim, a, m, wt, c);
        float chunk[STREAM_ROWS * 64] __attribute__((aligned(64)));
        for (int64_t j0 = 0; j0 < n; j0 += 64) {
            __mmask16 valid[4];
            column_masks(n, j0, valid);
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < 64 && j0 + j < n; j++) chunk[r * 64 + j] = c[r * n + j0 + j];
            update_rows(&s, 0, (int)m, chunk, j0, valid);
        }
        free(c);
        return finish(&s, m, n, ids, a);
    }
    float logits[6 * 64] __attribute__((aligned(64))); /* one tile's logits */
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
        __mmask16 valid[4];
        column_masks(n, j0, valid);
        /* small_gemm.h's next_stripe_line: the tiles after the first ask for the next stripe */
        const float *next = j0 + 64 < n ? wt + j0 + 64 : NULL;
        int64_t r0 = 0, t = 0;
        /* the first tile of a stripe walks it from memory and asks PF_ROWS rows ahead; the tiles after
         * it find the stripe (K x 256 bytes) in L1/L2 */
        for (; r0 + 6 <= m; r0 += 6, t++) {
            tile_6(kdim, a + r0, m, wt, n, j0, valid, r0 ? 0 : PF_ROWS, next_stripe_for(t, next), (t - 1) * kdim, logits);
            update_rows(&s, r0, 6, logits, j0, valid);
        }
        for (; r0 + 4 <= m; r0 += 4, t++) {
            tile_4(kdim, a + r0, m, wt, n, j0, valid, r0 ? 0 : PF_ROWS, next_stripe_for(t, next), (t - 1) * kdim, logits);
            update_rows(&s, r0, 4, logits, j0, valid);
        }
        for (; r0 + 2 <= m; r0 += 2, t++) {
            tile_2(kdim, a + r0, m, wt, n, j0, valid, r0 ? 0 : PF_ROWS, next_stripe_for(t, next), (t - 1) * kdim, logits);
            update_rows(&s, r0, 2, logits, j0, valid);
        }
        for (; r0 < m; r0++, t++) {
            tile_1(kdim, a + r0, m, wt, n, j0, valid, r0 ? 0 : PF_ROWS, next_stripe_for(t, next), (t - 1) * kdim, logits);
            update_rows(&s, r0, 1, logits, j0, valid);
        }
    }
    return finish(&s, m, n, ids, a);
}
#else
/* Without AVX-512 (AVX2 hosts such as AMD Zen 2 / 3, or none): the logits through small_gemm.h's
 * gemm_rows -- its AVX2 register tiles where the build has them, the stream otherwise, split among
 * the team on a wide thread -- into an [m][n] scratch, then one scan per row. gemm_rows sums each
 * logit k ascending, one multiply-add each, from zero, as the AVX-512 tiles above do, so every build
 * gives a row the same id. The logits are written here (the win of the AVX-512 path is not writing
 * them), but the scan reads them back at 8 lanes per compare instead of torch.argmax's pass, and the
 * sampler's per-row handling is skipped as there. It pays while gemm_rows streams the head (up to
 * STREAM_ROWS rows, 8 on AVX2); its register tiles lose to MKL on a head this wide. 2-core AVX2 EPYC
 * (Zen 3), 8k x 256 heads of 8 MB cycled, one thread, medians of 15 alternating, torch vs here: 2
 * rows 0.60 vs 0.57 ms, 4: 1.24 vs 0.78, 6: 1.41 vs 1.00, 8: 1.36 vs 1.21; 9 (tiles): 1.60 vs 1.74,
 * 16: 1.82 vs 2.28, 32: 3.02 vs 3.46. */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

/* the most rows for which this build beats MKL's GEMM + torch.argmax: those gemm_rows streams */
int greedy_head_fast_rows(void) { return STREAM_ROWS; }

/* argmax of x[0 .. n-1], ties to the lowest index, as torch.argmax for non-NaN rows (all -inf: 0);
 * returns 1 when an element is NaN (the id is then undefined), else 0. Each of 8 lanes keeps its
 * first maximum (a strict > never lets a later equal value or a NaN win), then the lanes meet. */
static int row_argmax(const float *x, int64_t n, int64_t *id) {
    vf8 best = (vf8){0} - __builtin_inff();
    vi8 idx = {0}, nan = {0}, cols = {0, 1, 2, 3, 4, 5, 6, 7};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const vf8 v = *(const vf8_unaligned *)(x + j);
        const vi8 win = v > best;
        best = (vf8)(((vi8)v & win) | ((vi8)best & ~win));
        idx = (idx & ~win) | (cols & win);
        nan |= v != v;
        cols += 8;
    }
    float top = -__builtin_inff();
    int64_t first = 0;
    int saw_nan = 0;
    for (int l = 0; l < 8; l++) {
        saw_nan |= nan[l] != 0;
        if (best[l] > top || (best[l] == top && idx[l] < first)) top = best[l], first = idx[l];
    }
    for (; j < n; j++) { /* the last columns: after every lane's, so a tie keeps the lanes' id */
        saw_nan |= x[j] != x[j];
        if (x[j] > top) top = x[j], first = j;
    }
    *id = first;
    return saw_nan;
}

int lm_head_argmax_f32(const float *h, int64_t m, int64_t kdim, const float *wt, int64_t n, int64_t *ids) {
    if (m <= 0) return 0;
    float *a = malloc((size_t)(kdim * m) * sizeof(float)); /* h transposed: gemm_rows' a */
    float *c = malloc((size_t)(m * n) * sizeof(float));
    if (!a || !c) {
        free(a);
        free(c);
        return -2;
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t k = 0; k < kdim; k++) a[k * m + r] = h[r * kdim + k];
    gemm_rows(m, n, kdim, a, m, wt, c);
    int status = 0;
    for (int64_t r = 0; r < m; r++) status |= row_argmax(c + r * n, n, ids + r);
    free(a);
    free(c);
    return status;
}
#endif
