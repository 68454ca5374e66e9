/* c = a^T b for a few rows: the weight-streaming GEMM of the C kernels (moe_experts.c,
 * attention_front.c, ...). Included, not linked: each kernel is its own shared object, and build.py
 * hashes the headers next to a source into its cache key.
 *
 *   a: the rows' activations transposed, a[k * lda + r] (the rows' k-th values side by side)
 *   b: W^T [kdim][n] row-major, as the kernel layout stores a weight (column-major W [n][kdim])
 *   c: [m][n], overwritten
 */

#ifndef MMSERVE_SMALL_GEMM_H
#define MMSERVE_SMALL_GEMM_H

#include <stdint.h>
#include <string.h>

#include "team.h"

/* c + x * b with one rounding where the CPU has a fused multiply-add, as the register tiles compute
 * it (their FMA instructions), so the stream and the tiles agree bit for bit. The kernels build with
 * -ffp-contract=fast, which fuses ``c + x * b`` too; fmaf keeps the agreement without that flag
 * (-std=c11 alone keeps the multiply and the add apart). GCC and Clang lower it inline and vectorize. */
#if defined(__FMA__)
#include <math.h>
#define MUL_ADD(x, b, c) fmaf((x), (b), (c))
#else
#define MUL_ADD(x, b, c) ((c) + (x) * (b))
#endif

#ifndef WIDE
#define WIDE 1024 /* outputs at least this wide read 4 rows of W^T per pass, narrower ones 2 */
#endif
#ifndef AHEAD
#define AHEAD 8192 /* bytes of b asked for ahead of the rows a pass reads (into L2) */
#endif

/* Ask for b's bytes [from, from + bytes) into L2. Prefetches never fault, so a range running past
 * the end of b is harmless (it reaches the next expert's weights, which the MoE kernel reads next). */
static inline void prefetch_l2(const float *from, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)from + o, 0, 2);
}

/* Register tiles (gemm_tiles below, greedy_head.c) walk b in 64-column stripes, 4 cache lines per row
 * of b. A stripe's first row tile reads it from memory; the tiles after it find it in L1 / L2 while
 * memory idles, so the 2nd to the 5th each ask for a quarter of the next stripe's lines, one per k,
 * in row order (``line`` = 4 * row + vector from the next stripe's start): that stripe's first tile
 * then computes instead of waiting on memory. 32 rows, weights from memory, main's build and this
 * one alternating (benchmarks/decoder_layer.py's shapes): attention front 1.11-1.22x, out
 * 1.14-1.19x, dense MLP 1.24-1.27x, LM head 8k x 256 1.15-1.20x; the same bits (only prefetches
 * differ). Prefetches never fault: a line past b's end is harmless. */
#define NEXT_STRIPE_TILES 4
static inline void next_stripe_line(const float *next, int64_t line, int64_t n) {
    if (next) __builtin_prefetch(next + (line >> 2) * n + 16 * (line & 3), 0, 2);
}

/* the next stripe for tile t of a stripe (0: its first), or NULL where tile t asks for none; tile t
 * asks for the lines from (t - 1) * kdim */
static inline const float *next_stripe_for(int64_t t, const float *next) {
    return t >= 1 && t <= NEXT_STRIPE_TILES ? next : NULL;
}

/* c[r][:] += a[k'][r] * b[k'][:] for k' = k, k+1 (pass4: to k+3), in that order, one multiply-add
 * each: those rows of b stream past once while all m rows of c take them in. */
static void pass2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, float *c) {
    const float *b0 = b + k * n, *b1 = b0 + n;
    for (int64_t r = 0; r < m; r++) {
        const float x0 = a[k * lda + r], x1 = a[(k + 1) * lda + r];
        float *restrict cr = c + r * n;
        for (int64_t j = 0; j < n; j++) cr[j] = MUL_ADD(x1, b1[j], MUL_ADD(x0, b0[j], cr[j]));
    }
}

static void pass4(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, float *c) {
    const float *b0 = b + k * n, *b1 = b0 + n, *b2 = b1 + n, *b3 = b2 + n;
    for (int64_t r = 0; r < m; r++) {
        const float x0 = a[k * lda + r], x1 = a[(k + 1) * lda + r], x2 = a[(k + 2) * lda + r],
                    x3 = a[(k + 3) * lda + r];
        float *restrict cr = c + r * n;
        for (int64_t j = 0; j < n; j++)
            cr[j] = MUL_ADD(x3, b3[j], MUL_ADD(x2, b2[j], MUL_ADD(x1, b1[j], MUL_ADD(x0, b0[j], cr[j]))));
    }
}

/* c [m][n] = a^T b. b is read once, front to back, 2 or 4 rows per pass; the m rows of c stay in
 * cache and the inner loop vectorises over n:
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
 * software prefetch): the weights then arrive in bursts, not as a steady stream. Each pass asks
 * for the bytes AHEAD (8 KB) past its rows into L2 (__builtin_prefetch, locality 2): from memory
 * (256 KB weights cycled through 64 MB; 256 x 256, C harness) 1 row 32 -> 14 us, 4 rows 47 -> 16 us,
 * 8 rows 57 -> 23 us; into L1 instead, or 16-32 KB ahead, was slower. The sum runs k
 * ascending, one multiply-add per k, whatever m is: a row's result does not depend on which rows
 * share the call. */
static void gemm_small_m(int64_t m, int64_t n, int64_t kdim, const float *a, int64_t lda, const float *b,
                         float *c) {
    memset(c, 0, (size_t)(m * n) * sizeof(float));
    int64_t k = 0;
    const int64_t row = n * (int64_t)sizeof(float);
    if (n >= WIDE)
        for (; k + 4 <= kdim; k += 4) {
            prefetch_l2(b + k * n + AHEAD / sizeof(float), 4 * row);
            pass4(m, n, k, a, lda, b, c);
        }
    for (; k + 2 <= kdim; k += 2) {
        prefetch_l2(b + k * n + AHEAD / sizeof(float), 2 * row);
        pass2(m, n, k, a, lda, b, c);
    }
    for (; k < kdim; k++) {
        const float *bk = b + k * n;
        for (int64_t r = 0; r < m; r++) {
            const float xr = a[k * lda + r];
            float *restrict cr = c + r * n;
            for (int64_t j = 0; j < n; j++) cr[j] = MUL_ADD(xr, bk[j], cr[j]);
        }
    }
}

/* c [m][ldc] (its first n columns) = a^T b, register tiles: MR rows x 64 columns of c stay in
 * registers (MR x 4 AVX-512 vectors) while k runs over all of b's rows, so each multiply-add costs
 * one broadcast shared by 4 vectors and one weight vector shared by MR rows, with no load or store
 * of c inside the k loop. gemm_small_m loads and stores c on every pass (its m rows of c stay in
 * L1, not in registers) and is bound by those loads and stores once the weights are in cache:
 * attention front, 32 rows x 384 x 256, one thread, warm (C harness): 145 us there, MKL 73 us,
 * here 61 us (benchmarks/decoder_layer.py measures the layer calls). Same order of operations per output as
 * gemm_small_m (k ascending, one multiply-add each, from zero), so the two agree bit for bit and a
 * row's result does not depend on the rows beside it. AVX2 + FMA without AVX-512: the 8-lane tiles
 * below; neither: gemm_small_m. */
#if defined(__AVX512F__) && !defined(SMALL_GEMM_AVX2) /* the AVX2 form: -DSMALL_GEMM_AVX2 (tests) */
#include <immintrin.h>

#define TILE_MR 6
#define STREAM_ROWS 4 /* gemm_rows: at most this many rows take the stream */
#ifndef TILE_PF
#define TILE_PF 8 /* rows of b ahead that the first row tile asks for (into L2) */
#endif
/* the 4 cache lines of a 64-column stripe pf rows of b ahead (pf 0: none), into L2 */
static inline void stripe_ahead(const float *bk, int64_t pf, int64_t n) {
    if (pf)
        for (int v = 0; v < 4; v++) __builtin_prefetch(bk + pf * n + 16 * v, 0, 2);
}

/* an edge tile: mr < TILE_MR rows or fewer than 64 columns (the last vector masked by ``last``) */
static void tile_rows(int64_t mr, int64_t kdim, const float *a, int64_t lda, const float *b, int64_t n,
                      int64_t j0, int64_t nv, __mmask16 last, float *c, int64_t ldc, int64_t pf, const float *next,
                      int64_t line0) {
    __m512 acc[TILE_MR][4];
    for (int r = 0; r < TILE_MR; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kdim; k++) {
        const float *bk = b + k * n + j0;
        stripe_ahead(bk, pf, n);
        next_stripe_line(next, line0 + k, n);
        __m512 bv[4];
        for (int v = 0; v < 4; v++)
            bv[v] = v < nv - 1 ? _mm512_loadu_ps(bk + 16 * v)
                  : v == nv - 1 ? _mm512_maskz_loadu_ps(last, bk + 16 * v) : _mm512_setzero_ps();
        const float *ak = a + k * lda;
        for (int r = 0; r < TILE_MR; r++) {
            if (r >= mr) break;
            const __m512 ar = _mm512_set1_ps(ak[r]);
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < TILE_MR && r < mr; r++)
        for (int v = 0; v < nv; v++) {
            float *cr = c + r * ldc + j0 + 16 * v;
            if (v < nv - 1) _mm512_storeu_ps(cr, acc[r][v]);
            else _mm512_mask_storeu_ps(cr, last, acc[r][v]);
        }
}

/* the full tile, every bound a constant: the compiler keeps the 24 accumulators in registers (one
 * generic tile inlined with these constants ran 2.7x slower: its accumulators went to the stack) */
static void tile_full(int64_t kdim, const float *a, int64_t lda, const float *b, int64_t n, int64_t j0, float *c,
                      int64_t ldc, int64_t pf, const float *next, int64_t line0) {
    __m512 acc[TILE_MR][4] = {0}; /* every accumulator zero */
    for (int64_t k = 0; k < kdim; k++) {
        const float *bk = b + k * n + j0;
        stripe_ahead(bk, pf, n);
        next_stripe_line(next, line0 + k, n);
        const __m512 b0 = _mm512_loadu_ps(bk), b1 = _mm512_loadu_ps(bk + 16), b2 = _mm512_loadu_ps(bk + 32),
                     b3 = _mm512_loadu_ps(bk + 48);
        const float *ak = a + k * lda;
        for (int r = 0; r < TILE_MR; r++) {
            const __m512 ar = _mm512_set1_ps(ak[r]);
            acc[r][0] = _mm512_fmadd_ps(ar, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(ar, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(ar, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(ar, b3, acc[r][3]);
        }
    }
    for (int r = 0; r < TILE_MR; r++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(c + r * ldc + j0 + 16 * v, acc[r][v]);
}

static void gemm_tiles(int64_t m, int64_t n, int64_t kdim, const float *a, int64_t lda, const float *b, float *c,
                       int64_t ldc, int64_t j_lo, int64_t j_hi) {
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += 64) {
        const int64_t cols = j_hi - j0 < 64 ? j_hi - j0 : 64;
        const int64_t nv = (cols + 15) / 16;
        const __mmask16 last = (__mmask16)((1u << (cols - 16 * (nv - 1))) - 1u);
        const float *next = j0 + 64 < j_hi ? b + j0 + 64 : NULL;
        for (int64_t r0 = 0, t = 0; r0 < m; r0 += TILE_MR, t++) {
            const int64_t mr = m - r0 < TILE_MR ? m - r0 : TILE_MR;
            const int64_t pf = r0 == 0 ? TILE_PF : 0; /* the first rows' walk brings the stripe in */
            const float *ahead = next_stripe_for(t, next); /* the later ones the next stripe */
            if (mr == TILE_MR && cols == 64)
                tile_full(kdim, a + r0, lda, b, n, j0, c + r0 * ldc, ldc, pf, ahead, (t - 1) * kdim);
            else tile_rows(mr, kdim, a + r0, lda, b, n, j0, nv, last, c + r0 * ldc, ldc, pf, ahead, (t - 1) * kdim);
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA (AMD Zen 2 / 3, Intel before AVX-512): 16 vector registers of 8 floats, so 6 rows x 16
 * columns of c (12 accumulators, 2 weight vectors, 1 broadcast) over 16-column stripes of b, one
 * cache line per k: a stripe (kdim lines) stays in L1 for its row tiles. 4 rows x 24 columns (12
 * accumulators + 3 weight vectors + 1 broadcast: all 16 registers) ran 143 vs 82 us (32 x 384 x 256,
 * warm). The accumulators are named variables: as an array GCC stored them to the stack every k (10
 * instead of 7 cycles per k). An edge tile's missing rows repeat its last row of a (computed, not
 * stored: a row edge costs a full tile); the last stripe's missing columns are masked loads and
 * stores, used only there. The first row tile of each 64-column group asks for the group's 4 lines
 * TILE_PF rows ahead (one line per stripe instead: wide outputs from memory 12 x 8192 x 256 2.04 vs
 * 1.76 ms for the stream, 9 x 1024 x 256 192 vs 158 us; grouped 1.71-1.76 ms and 155-163 us). C
 * harness, one thread, EPYC (Zen 3, 2.45 GHz), gemm_rows, main's stream -> these tiles, warm / from
 * memory (64 MB of weights cycled): 32 x 384 x 256 (attention front) 200 -> 87 / 218 -> 101 us, 32 x
 * 512 x 256 264 -> 130 / 279 -> 136, 32 x 256 x 512 251 -> 140 / 253 -> 154; up to 8 rows the stream
 * stays (STREAM_ROWS: 6 x 1024 x 256 from memory 122 vs 144 us tiles, 8 x 4096 x 256 627 vs 638).
 * The layer calls, 32 rows (benchmarks/decoder_layer.py --quick, medians of 3 alternating with main):
 * attention front 162 -> 111 us, out 121 -> 84, dense MLP 725 -> 458. */
#include <immintrin.h>

#define TILE_MR 6
#define STREAM_ROWS 8
#ifndef TILE_PF
#define TILE_PF 8 /* rows of b ahead that the first row tile asks for (into L2) */
#endif

/* one rounding, as gemm_small_m's MUL_ADD */
static inline __m256 mul_add(__m256 x, __m256 b, __m256 acc) { return _mm256_fmadd_ps(x, b, acc); }

static inline __attribute__((always_inline)) void tile6(int64_t kdim, const float *a, int64_t lda, const float *b,
                                                        int64_t n, int64_t j0, float *c, int64_t ldc, int64_t pf,
                                                        int masked, int64_t mr, __m256i m0, __m256i m1) {
    /* an edge tile's missing rows repeat its last row (no read past a), their results are not stored */
    const int64_t r1 = 1 < mr ? 1 : mr - 1, r2 = 2 < mr ? 2 : mr - 1, r3 = 3 < mr ? 3 : mr - 1,
                  r4 = 4 < mr ? 4 : mr - 1, r5 = 5 < mr ? 5 : mr - 1;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kdim; k++) {
        const float *bk = b + k * n + j0;
        if (pf) /* the 4 lines of the 64 columns from j0 (a group's first stripe asks for the group) */
            for (int v = 0; v < 4; v++) __builtin_prefetch(bk + pf * n + 16 * v, 0, 2);
        const __m256 b0 = masked ? _mm256_maskload_ps(bk, m0) : _mm256_loadu_ps(bk),
                     b1 = masked ? _mm256_maskload_ps(bk + 8, m1) : _mm256_loadu_ps(bk + 8);
        const float *ak = a + k * lda;
        __m256 x = _mm256_broadcast_ss(ak);
        c00 = mul_add(x, b0, c00), c01 = mul_add(x, b1, c01);
        x = _mm256_broadcast_ss(ak + r1);
        c10 = mul_add(x, b0, c10), c11 = mul_add(x, b1, c11);
        x = _mm256_broadcast_ss(ak + r2);
        c20 = mul_add(x, b0, c20), c21 = mul_add(x, b1, c21);
        x = _mm256_broadcast_ss(ak + r3);
        c30 = mul_add(x, b0, c30), c31 = mul_add(x, b1, c31);
        x = _mm256_broadcast_ss(ak + r4);
        c40 = mul_add(x, b0, c40), c41 = mul_add(x, b1, c41);
        x = _mm256_broadcast_ss(ak + r5);
        c50 = mul_add(x, b0, c50), c51 = mul_add(x, b1, c51);
    }
    const __m256 rows[TILE_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int64_t r = 0; r < mr; r++) {
        float *cr = c + r * ldc + j0;
        if (masked) _mm256_maskstore_ps(cr, m0, rows[r][0]), _mm256_maskstore_ps(cr + 8, m1, rows[r][1]);
        else _mm256_storeu_ps(cr, rows[r][0]), _mm256_storeu_ps(cr + 8, rows[r][1]);
    }
}

/* the full tile and a row edge: plain loads and stores */
static void tile_rows(int64_t mr, int64_t kdim, const float *a, int64_t lda, const float *b, int64_t n, int64_t j0,
                      float *c, int64_t ldc, int64_t pf) {
    const __m256i all = _mm256_set1_epi32(-1);
    if (mr == TILE_MR) tile6(kdim, a, lda, b, n, j0, c, ldc, pf, 0, TILE_MR, all, all); /* mr constant */
    else tile6(kdim, a, lda, b, n, j0, c, ldc, pf, 0, mr, all, all);
}

/* a column edge (fewer than 16 columns left): masked loads and stores, only there (a masked load
 * costs more than a plain one) */
static void tile_cols(int64_t mr, int64_t cols, int64_t kdim, const float *a, int64_t lda, const float *b, int64_t n,
                      int64_t j0, float *c, int64_t ldc, int64_t pf) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lane),
                  m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols - 8), lane);
    tile6(kdim, a, lda, b, n, j0, c, ldc, pf, 1, mr, m0, m1);
}

static void gemm_tiles(int64_t m, int64_t n, int64_t kdim, const float *a, int64_t lda, const float *b, float *c,
                       int64_t ldc, int64_t j_lo, int64_t j_hi) {
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += 16) {
        const int64_t cols = j_hi - j0 < 16 ? j_hi - j0 : 16;
        for (int64_t r0 = 0; r0 < m; r0 += TILE_MR) {
            const int64_t mr = m - r0 < TILE_MR ? m - r0 : TILE_MR;
            const int64_t pf = r0 == 0 && j0 % 64 == 0 ? TILE_PF : 0; /* the first rows' walk brings the group in */
            if (cols == 16) tile_rows(mr, kdim, a + r0, lda, b, n, j0, c + r0 * ldc, ldc, pf);
            else tile_cols(mr, cols, kdim, a + r0, lda, b, n, j0, c + r0 * ldc, ldc, pf);
        }
    }
}
#else
#define STREAM_ROWS 4
#define NO_TILES 1
static void gemm_tiles(int64_t m, int64_t n, int64_t kdim, const float *a, int64_t lda, const float *b, float *c,
                       int64_t ldc, int64_t j_lo, int64_t j_hi) {
    (void)j_lo, (void)j_hi; /* never split: called with the whole width */
    if (ldc == n) {
        gemm_small_m(m, n, kdim, a, lda, b, c);
        return;
    }
    for (int64_t r = 0; r < m; r++) gemm_small_m(1, n, kdim, a + r, lda, b, c + r * ldc);
}
#endif

/* c [m][n] = a^T b by whichever of the two is faster for m rows of c: the stream (gemm_small_m)
 * while c stays small in L1, register tiles past that. Both give the same bits (same order of
 * multiply-adds), so the switch cannot change a row's result. Up to STREAM_ROWS rows the stream
 * serves whatever n is. AVX-512 tiles, measured from memory (C harness, one thread, 256 KB weights
 * cycled through 64 MB, n = 256): m = 4: 20 vs 51 us, 8: 22 vs 36, 16: 42 vs 51, 24: 53 vs 52, 32:
 * 68 vs 63; n = 384, m = 32: 178 vs 95.
 *
 * On a wide thread a call with enough work (team.h split_work_on_team) splits the tiles' 64-column
 * groups among the team: each output column is computed by one thread exactly as the serial walk
 * computes it, so the bits do not change; the stream (a few rows) stays serial. */
static void gemm_rows(int64_t m, int64_t n, int64_t kdim, const float *a, int64_t lda, const float *b, float *c) {
    if (m <= STREAM_ROWS || m * n <= 4096) {
        gemm_small_m(m, n, kdim, a, lda, b, c);
        return;
    }
#if defined(_OPENMP) && !defined(NO_TILES)
    if (split_work_on_team(m * n * kdim)) {
        const int64_t groups = (n + 63) / 64;
#pragma omp parallel
        {
            const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
            const int64_t lo = groups * me / nt * 64, hi0 = groups * (me + 1) / nt * 64, hi = hi0 < n ? hi0 : n;
            if (lo < hi) gemm_tiles(m, n, kdim, a, lda, b, c, n, lo, hi);
        }
        return;
    }
#endif
    gemm_tiles(m, n, kdim, a, lda, b, c, n, 0, n);
}

#endif
