/* Row operations shared by the decode-layer kernels (decoder_layer.c, mtp_draft.c): one owner for the
 * RMSNorm and rotary arithmetic, so every C path rounds the same way. */
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

#endif
