/* One decoder layer of an all-decode step in one call: the four C kernels a decode layer runs,
 * chained here instead of from Python.
 *
 *   attention_front_f32      (decoder_layer.c: norm, QKV, RoPE, value scale, KV store) -> qkv [T][N]
 *   paged_decode_attention   (paged_decode.c: each row over its keys in the pool)     -> attn [T][Hq*Dv]
 *   attention_out_f32        (decoder_layer.c: o_proj, residual add, post-attn norm)  -> x1, h [T][H]
 *   moe_route_experts_f32    (moe_experts.c) or dense_mlp_f32 (decoder_layer.c)      -> out = x1 + mlp(h)
 *
 * Why: between those calls the Python side spent ~100 us per layer on argument checks, views and
 * ctypes conversions of the same pointers (benchmarks/profile_step.py). The kernels are called through the
 * addresses of their own built libraries (passed in ``layer``), so each runs exactly the machine
 * code it runs when Python calls it: tokens and logprobs stay bit-identical.
 *
 * ``layer``: the layer's constants (weights, shapes, kernel addresses), built once per layer;
 * ``step``: the step's decode metadata for this layer's pool (rotary tables, slots, block table),
 * built once per step and pool. Both are int64 arrays indexed by the enums below, which
 * kernels/native/fused_layer.py mirrors.
 *
 * The last layer of a short prefill step (a question after a prefix-cache hit) needs every row's
 * K/V but the output of its logits rows only (DecoderLayer.forward_logits_rows): ``step[S_PICK]``
 * then names those rows of x, in increasing order. The front still runs over all S_T rows; the
 * attention (a decode row each over the pool, which holds the step's keys by then), o_proj and the
 * MLP run over the S_AT picked rows alone. Part by part that layer was six calls and their Python
 * glue (the same-prefix step's last layer, 24 rows: 0.58 -> 0.42 ms); the kernels and their inputs
 * are the same, so are the bits.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { L_FRONT, L_ATTN, L_OUT, L_MLP, L_MOE, L_H, L_HQ, L_HKV, L_D, L_DV, L_R, L_NORM_IN, L_WQKV, L_SINKS,
       L_WO, L_NORM_POST, L_I, L_E, L_K, L_W1, L_W2, L_W3, L_BIAS, L_NGROUP, L_TOPKGROUP, L_RENORM, L_COUNT };
enum { F_EPS_IN, F_VSCALE, F_SCALE, F_EPS_POST, F_ROUTED, F_COUNT };
/* S_T: the front's rows (x's); S_AT: the attention's decode rows = the rows out; S_PICK: 0 (S_AT == S_T,
 * every row out) or int64[S_AT], the rows of x that go on, strictly increasing */
enum { S_T, S_COS, S_SIN, S_SLOTS, S_TABLE, S_TABLE_COLS, S_LENS, S_REQS, S_ROWS, S_PAGE, S_WINDOW, S_CHUNK_AFTER,
       S_AT, S_PICK, S_COUNT };

typedef int (*front_fn)(const float *, int64_t, int64_t, const float *, float, const float *, int64_t, int64_t,
                        int64_t, int64_t, int64_t, const float *, const float *, float, float *, float *, int64_t,
                        const int64_t *, float *);
typedef long (*attn_fn)(const float *, long, const float *, const float *, long, const long *, long, const long *,
                        const long *, const long *, long, const float *, float *, long, long, long, long, long, long,
                        long, float, long, long *);
typedef int (*out_fn)(const float *, int64_t, int64_t, const float *, const float *, int64_t, const float *, float,
                      float *, float *);
typedef int (*moe_fn)(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, const float *, const float *,
                      int64_t, int64_t, int, float, const float *, const float *, float *, int64_t *, const float *,
                      float *);
typedef int (*dense_fn)(const float *, int64_t, int64_t, int64_t, const float *, const float *, const float *,
                        const float *, float *);

#define P(a, i) ((void *)(intptr_t)(a)[i])

/* x [T][H]; k_cache [num_slots][Hkv][D], v_cache [num_slots][Hkv][Dv]; xho [3][R][H] (R = S_AT: T, or
 * the picked rows) receives x1 = x + o_proj(attn), h = norm(x1) and out = x1 + mlp(h) of those rows.
 * Return 0; 1 when the router's choice is ambiguous (x1 and h written, out not: the caller routes
 * in torch, as moe_route_experts_f32's caller does); 10 + the attention kernel's status 1 / 2
 * (error[] set, as paged_decode_attention sets it); -1 a slot at or past num_slots (nothing
 * written); -2 out of memory. */
int decode_layer_f32(const int64_t *layer, const float *f, const int64_t *step, const float *x, float *k_cache,
                     float *v_cache, int64_t num_slots, float *xho, long *error) {
    const int64_t T = step[S_T], R = step[S_AT], H = layer[L_H], Hq = layer[L_HQ], Hkv = layer[L_HKV],
                  D = layer[L_D], Dv = layer[L_DV];
    const int64_t N = (Hq + Hkv) * D + Hkv * Dv, A = Hq * Dv;
    const int64_t *pick = P(step, S_PICK);
    if (T == 0) return 0;
    float *qkv = malloc((size_t)(T * N + R * A + (pick ? R * H : 0)) * sizeof(float));
    if (!qkv) return -2;
    float *attn = qkv + T * N, *x1 = xho, *h = xho + R * H, *out = xho + 2 * R * H;
    const float *xr = x; /* the residual rows: x, or its picked rows */
    int rc = ((front_fn)P(layer, L_FRONT))(x, T, H, P(layer, L_NORM_IN), f[F_EPS_IN], P(layer, L_WQKV), Hq, Hkv, D,
                                            Dv, layer[L_R], P(step, S_COS), P(step, S_SIN), f[F_VSCALE], k_cache,
                                            v_cache, num_slots, P(step, S_SLOTS), qkv);
    if (rc) goto done;
    if (pick) { /* the picked rows to the front of qkv, in order: pick[i] >= i, so no source is overwritten early */
        float *xs = attn + R * A;
        for (int64_t i = 0; i < R; i++) {
            if (pick[i] != i) memmove(qkv + i * N, qkv + pick[i] * N, (size_t)N * sizeof(float));
            memcpy(xs + i * H, x + pick[i] * H, (size_t)H * sizeof(float));
        }
        xr = xs;
    }
    if (R == 0) goto done;
    /* every row decodes, in order (the plan's all_decode): row i is request reqs[i], query row rows[i] */
    long st = ((attn_fn)P(layer, L_ATTN))(qkv, N, k_cache, v_cache, num_slots, P(step, S_TABLE), step[S_TABLE_COLS],
                                          P(step, S_LENS), P(step, S_REQS), P(step, S_ROWS), R, P(layer, L_SINKS),
                                          attn, A, Hq, Hkv, D, Dv, step[S_PAGE], step[S_WINDOW], f[F_SCALE], step[S_CHUNK_AFTER],
                                          error);
    if (st) {
        rc = st < 0 ? -2 : 10 + (int)st;
        goto done;
    }
    rc = ((out_fn)P(layer, L_OUT))(attn, R, A, P(layer, L_WO), xr, H, P(layer, L_NORM_POST), f[F_EPS_POST], x1, h);
    if (rc) goto done;
    if (layer[L_MOE]) {
        int64_t *ids = malloc((size_t)(R * layer[L_K]) * (sizeof(int64_t) + sizeof(float)));
        if (!ids) {
            rc = -2;
            goto done;
        }
        float *w = (float *)(ids + R * layer[L_K]);
        rc = ((moe_fn)P(layer, L_MLP))(h, R, H, layer[L_I], layer[L_E], layer[L_K], P(layer, L_W1), P(layer, L_BIAS),
                                        layer[L_NGROUP], layer[L_TOPKGROUP], (int)layer[L_RENORM], f[F_ROUTED],
                                        P(layer, L_W2), P(layer, L_W3), w, ids, x1, out);
        free(ids);
    } else {
        rc = ((dense_fn)P(layer, L_MLP))(h, R, H, layer[L_I], P(layer, L_W1), P(layer, L_W2), P(layer, L_W3), x1, out);
    }
done:
    free(qkv);
    return rc;
}
