/* Row operations shared by the C kernels (decoder_layer.c, mtp_draft.c, moe_experts.c, paged_decode.c):
 * one owner for the RMSNorm, rotary, exp and SiLU arithmetic, so every C path rounds the same way. */
#ifndef MMSERVE_ROW_OPS_H
#define MMSERVE_ROW_OPS_H

#include <math.h>
#include <stdint.h>

/* out[k * step] = x[k] * inv_rms(x) (* w[k] when w is given) for k < H; step 1 writes a row, step T a
 * column of a transposed [H][T] block (a GEMM's input). 16 running sums: the loop vectorises (torch
 * sums in lanes too). */
static inline void rms_row(const float *x, int64_t H, const float *w, float eps, float *out, int64_t step) {
    float lanes[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= H; k += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[k + l] * x[k + l];
    float ss = 0.0f;
    for (; k < H; k++) ss += x[k] * x[k];
    for (int l = 0; l < 16; l++) ss += lanes[l];
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (k = 0; k < H; k++) out[k * step] = w ? (x[k] * inv) * w[k] : x[k] * inv;
}

/* head [D]: its first R dims as [x1 | x2] (halves of R/2) become [x1 c - x2 s | x2 c + x1 s]; the
 * tables hold cos as [c | c] and the sine signed as [-s | s] (llm_core/model/layers/rope.py); dims
 * past R stay. */
static inline void rope_head(float *head, int64_t R, const float *cos, const float *ssin) {
    const int64_t half = R / 2;
    for (int64_t j = 0; j < half; j++) {
        const float x1 = head[j], x2 = head[j + half];
        head[j] = x1 * cos[j] + x2 * ssin[j];
        head[j + half] = x2 * cos[j + half] + x1 * ssin[j + half];
    }
}

/* e^x to ~2 ulp, written so the compiler vectorizes a loop of it (libm's expf is a scalar call per
 * element: ~2% of a 376-row prefill step's CPU in the experts' SiLU alone). x = n ln2 + r, |r| <=
 * ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n through the exponent bits. Below -87.3 (e^x
 * under FLT_MIN) the result is 0, above 88 (near FLT_MAX) +inf. EXP_STEPS is the arithmetic for a
 * float or a vector xc (x clamped to [-87.3, 88]): n rounded to nearest through the float adder
 * (1.5 * 2^23 pushes the fraction out: no libm call; |x log2 e| < 2^22 here), r against ln2 in a high
 * part (exact product for |n| < 2^10) and a low one, then the polynomial. */
#define EXP_LO (-87.3f)
#define EXP_HI 88.0f
#define EXP_STEPS(xc, n, p)                                                                                   \
    n = ((xc) * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                                           \
    p = ((xc) - n * 0.693145751953125f) - n * 1.428606765330187045e-06f; /* r */                             \
    p = (((((((1.0f / 720.0f) * p + 1.0f / 120.0f) * p + 1.0f / 24.0f) * p + 1.0f / 6.0f) * p + 0.5f) * p +  \
           1.0f) * p + 1.0f)
static inline float exp_approx(float x) {
    float xc = x < EXP_LO ? EXP_LO : x > EXP_HI ? EXP_HI : x, n, p;
    EXP_STEPS(xc, n, p);
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    const float y = p * scale.f;
    return x < EXP_LO ? 0.0f : x > EXP_HI ? INFINITY : y;
}

/* out[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u (the formula torch's silu uses), i < n; out may be g.
 * A large negative g gives e^-g = inf and -0, as torch. */
static inline void silu_mul_row(const float *g, const float *u, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
}

#endif
