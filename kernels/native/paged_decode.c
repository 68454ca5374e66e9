/* Paged decode attention: one query token per request over its keys, read in place from the pool.
 *
 * Contract: kernels/attention_ref.py (paged_attention_ref) restricted to decode rows; the Python
 * wrapper kernels/native/paged_decode.py checks dtypes, layouts and shapes before the call.
 *
 *   k_cache [num_slots, hkv, dqk], v_cache [num_slots, hkv, dv]   slot = page * page_size + offset
 *   request i: context L = seq_lens[req[i]], visible keys [first, L), first = max(0, L - window)
 *
 *     logical pos:  first ............................ L-1
 *     page:         table[req[i], pos / page_size]   (-1: released -> error, never read)
 *     slot:         page * page_size + pos % page_size
 *
 * Only positions < L are touched, so the unwritten tail of a request's last page (stale values, NaN)
 * never reaches a logit. A request's keys go by in blocks (their slots worked out once per block, all
 * KV heads of a slot read together); in a block, the G = hq / hkv query heads of each KV head's group
 * take its K and V rows together, so each row is read once per KV head; the logits of a block go
 * through one online-softmax update per query head (running max m, running sum l, fp32), and a
 * per-head sink logit joins the denominator only: out = acc / (l + e^(sink - m)).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "row_ops.h"
#include "team.h"

#define BLOCK 32 /* keys per online-softmax update (a multiple of 4): the logits of a block stay in L1 */
#ifndef WHOLE_AHEAD
#define WHOLE_AHEAD (128 * 1024) /* bytes of K/V up to which the next request is asked for whole */
#endif

/* Vectors through GCC / Clang vector extensions: the compiler lowers them to the host's registers
 * (-march=native) and the sums below stay in registers, where a reduction loop the compiler
 * vectorizes itself spills each lane to the stack. */
#if defined(__AVX512F__) && !defined(PAGED_DECODE_VL8) /* the 8-lane form: -DPAGED_DECODE_VL8 (tests) */
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_unaligned __attribute__((vector_size(VL * 4), aligned(4), may_alias));
static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf x) { *(vf_unaligned *)p = x; }

/* The logits' e^x (x <= 0) through row_ops.h exp_approx: libm's expf is a scalar call per logit, which
 * at one query per request is most of the arithmetic. exp_nonpositive_v: the same on a vector, lane by
 * lane (GCC's C has no vector ?:, so the selects are through masks), for the chunk path's logits, a
 * block of them per query. */
typedef int32_t vi __attribute__((vector_size(VL * 4)));
static inline vi lane_index(void) {
#if VL == 16
    return (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    return (vi){0, 1, 2, 3, 4, 5, 6, 7};
#endif
}
static inline vf exp_nonpositive_v(vf x) {
    const vf lo = (vf){0} + EXP_LO;
    const vi under = x < lo;
    const vf xc = (vf)(((vi)x & ~under) | ((vi)lo & under));
    vf n, p;
    EXP_STEPS(xc, n, p);
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)scale) & ~under);
}

/* The lane sums of a0 .. a3 -> out[0 .. 3]: pairs of vectors folded into one by halves, then the
 * four lane groups within one vector (log2(VL) shuffle + add steps for four sums, no spill). */
static inline void lane_sums4(vf a0, vf a1, vf a2, vf a3, float *out) {
#if VL == 16
    vf c01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf c23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* lanes: a0 x4 | a1 x4 | a2 x4 | a3 x4 */
    vf d = __builtin_shufflevector(c01, c23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c01, c23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    vf e = d + __builtin_shufflevector(d, d, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    vf f = e + __builtin_shufflevector(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = f[0];
    out[1] = f[4];
    out[2] = f[8];
    out[3] = f[12];
#else
    vf c01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    vf c23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    /* lanes: a0 x2 | a1 x2 | a2 x2 | a3 x2 */
    vf d = __builtin_shufflevector(c01, c23, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(c01, c23, 2, 3, 6, 7, 10, 11, 14, 15);
    vf e = d + __builtin_shufflevector(d, d, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = e[0];
    out[1] = e[2];
    out[2] = e[4];
    out[3] = e[6];
#endif
}

/* Four dot products of one query row with four key rows: four independent accumulator chains, the
 * query loaded once for the four keys; head dims that are not a multiple of VL finish in scalars. */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3,
                        long n, float *out) {
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long d = 0;
    for (; d + VL <= n; d += VL) {
        vf qv = load(q + d);
        a0 += qv * load(k0 + d);
        a1 += qv * load(k1 + d);
        a2 += qv * load(k2 + d);
        a3 += qv * load(k3 + d);
    }
    lane_sums4(a0, a1, a2, a3, out);
    for (; d < n; d++) {
        out[0] += q[d] * k0[d];
        out[1] += q[d] * k1[d];
        out[2] += q[d] * k2[d];
        out[3] += q[d] * k3[d];
    }
}

/* Ask for the K and V rows (all KV heads of a slot) of logical positions [from, to) through a
 * block-table row, one cache line at a time, a block ahead of their use: a decode step's K/V come
 * from memory (the weights streamed since the last layer evicted them), and pages lie anywhere in
 * the pool, where the hardware prefetchers stop at every 4 KB page. Invalid page ids are skipped
 * (the attention reports them when it gets there). */
static void prefetch_positions(const float *k_cache, const float *v_cache, const long *pages, long page_size,
                               long num_pages, long from, long to, long k_row, long v_row) {
    while (from < to) {
        long page = pages[from / page_size], offset = from % page_size;
        long n = page_size - offset < to - from ? page_size - offset : to - from;
        if (page >= 0 && page < num_pages) {
            const char *k = (const char *)(k_cache + (page * page_size + offset) * k_row);
            const char *v = (const char *)(v_cache + (page * page_size + offset) * v_row);
            /* into L2 (locality 1), not L1: a block of rows ahead does not fit beside the block in use,
             * and the L1 prefetch took ~1/3 longer with the caches emptied before the call */
            for (long b = 0; b < n * k_row * 4; b += 64) __builtin_prefetch(k + b, 0, 1);
            for (long b = 0; b < n * v_row * 4; b += 64) __builtin_prefetch(v + b, 0, 1);
        }
        from += n;
    }
}

/* The next request's K/V (a short context: asked for whole), or the next block of keys / the next
 * request's first block (a long one), asked for a few lines at a time from inside the loops over
 * this request's (this block's) keys, so the fetch runs while they compute. Asked for all at once
 * (as before; -DPAGED_DECODE_BURST_AHEAD builds that, for the tests' bit-for-bit comparison), the
 * prefetches stall on full miss buffers until nearly all of them are under way -- the core waits
 * ~ the fetch time -- and then the request computes with memory idle: fetch and compute took turns. ``per_call`` lines per call, spread
 * evenly over the calls this request makes (one per 4 keys and KV head in each of its K and V
 * loops); positions on invalid pages are skipped. Only prefetches differ: the same bits. Measured
 * (benchmarks/paged_decode.py's shapes, 32 requests, caches emptied before each call, medians of
 * 31 alternating): text_throughput model, full layer 488 -> 230 us, sliding layer 340 -> 173 us;
 * the long contexts' blocks spread too (25 alternating, load ~8): MiMo-V2.5 full 4k, 4 requests
 * 12.0 -> 9.3 ms, sliding, 32 requests 4.8 -> 3.7 ms. */
#ifndef AHEAD_LOCALITY
#define AHEAD_LOCALITY 3 /* into L1 (and L2); 0 (non-temporal) measured the same, 1-2 (L2) ~1.2x slower */
#endif
typedef struct {
    const char *k_cache, *v_cache;
    const long *pages;
    long page_size, num_pages, pos, to, k_bytes, v_bytes; /* bytes of a slot's K / V rows */
    long byte;        /* of the current position's K then V rows already asked for */
    const char *k, *v; /* the current position's rows (NULL: not worked out yet / skipped) */
    long per_call;
} Ahead;

static void ahead_init(Ahead *a, const float *k_cache, const float *v_cache, const long *pages, long page_size,
                       long num_pages, long from, long to, long k_row, long v_row, long calls) {
    const long lines = (to - from) * ((k_row * 4 + 63) / 64 + (v_row * 4 + 63) / 64);
    *a = (Ahead){(const char *)k_cache, (const char *)v_cache, pages, page_size, num_pages, from, to, k_row * 4,
                 v_row * 4, 0, NULL, NULL, calls > 0 ? (lines + calls - 1) / calls : lines};
}

static inline void ahead_lines(Ahead *a) {
    if (!a) return;
    for (long i = 0; i < a->per_call && a->pos < a->to; i++) {
        if (!a->k) {
            const long page = a->pages[a->pos / a->page_size];
            if (page < 0 || page >= a->num_pages) { /* the attention reports it when it gets there */
                a->pos++;
                continue;
            }
            const long slot = page * a->page_size + a->pos % a->page_size;
            a->k = a->k_cache + slot * a->k_bytes;
            a->v = a->v_cache + slot * a->v_bytes;
        }
        if (a->byte < a->k_bytes) __builtin_prefetch(a->k + a->byte, 0, AHEAD_LOCALITY);
        else __builtin_prefetch(a->v + (a->byte - a->k_bytes), 0, AHEAD_LOCALITY);
        a->byte += 64;
        if (a->byte >= a->k_bytes + a->v_bytes) {
            a->byte = 0;
            a->k = NULL;
            a->pos++;
        }
    }
}

/* acc[:dv] += p[0] v0 + p[1] v1 + p[2] v2 + p[3] v3 */
static inline void accumulate4(const float *p, const float *v0, const float *v1, const float *v2, const float *v3,
                               float *a, long dv) {
    const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
    long d = 0; /* explicit vectors: a loop the compiler vectorizes itself checks a against v0-v3
                 * for overlap on every call, which at dv = 32 costs more than the FMAs */
    for (; d + VL <= dv; d += VL)
        store(a + d, load(a + d) + p0 * load(v0 + d) + p1 * load(v1 + d) + p2 * load(v2 + d) + p3 * load(v3 + d));
    for (; d < dv; d++) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
}

/* One block of n (<= BLOCK, padded to a multiple of 4 by repeating the last slot) keys for the g
 * queries of KV head h: logits, online-softmax update of m / l / acc, acc += p V.
 *
 * ``lims`` (NULL: every query sees all n): query j sees the block's first lims[j] keys only (a row
 * of a group, attend_group). It then computes exactly what it would in a block of lims[j] keys of
 * its own -- the same logits, the same max and sum over the same keys, the keys past its end
 * weighing 0 against the V rows a block of its own repeats (its last key's), and no 4-key step
 * wholly past its end -- so a row's output does not depend on the rows grouped with it. */
static void attend_block(const float *qs, long g, const float *k_cache, const float *v_cache, long hkv, long h,
                         long dqk, long dv, const long *slots, long n, const long *lims, float *logits, float *acc,
                         float *m, float *l, Ahead *ahead, Ahead *block_ahead) {
    long n4 = (n + 3) / 4 * 4;
    for (long t = 0; t < n4; t += 4) { /* four K rows, every query head of the group */
        const float *k0 = k_cache + (slots[t] * hkv + h) * dqk, *k1 = k_cache + (slots[t + 1] * hkv + h) * dqk;
        const float *k2 = k_cache + (slots[t + 2] * hkv + h) * dqk, *k3 = k_cache + (slots[t + 3] * hkv + h) * dqk;
        for (long j = 0; j < g; j++)
            if (!lims || lims[j] > t) dot4(qs + j * dqk, k0, k1, k2, k3, dqk, logits + j * BLOCK + t);
        ahead_lines(ahead);
        ahead_lines(block_ahead);
    }
    for (long j = 0; j < g; j++) {
        const long nj = lims ? lims[j] : n, nj4 = (nj + 3) / 4 * 4;
        if (nj <= 0) continue; /* past this query's keys: nothing to add */
        float *s = logits + j * BLOCK;
        float mb = m[j];
#pragma omp simd reduction(max : mb)
        for (long t = 0; t < nj; t++) mb = s[t] > mb ? s[t] : mb;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (long t = 0; t < nj; t++) {
            s[t] = exp_approx(s[t] - mb);
            sum += s[t];
        }
        for (long t = nj; t < nj4; t++) s[t] = 0.0f; /* the repeated keys weigh nothing */
        if (mb != m[j]) { /* a new running max: rescale what was summed under the old one */
            float alpha = exp_approx(m[j] - mb); /* m = -inf (first block): 0 */
            l[j] *= alpha;
            float *a = acc + j * dv;
#pragma omp simd
            for (long d = 0; d < dv; d++) a[d] *= alpha;
            m[j] = mb;
        }
        l[j] += sum;
    }
    for (long t = 0; t < n4; t += 4) { /* four V rows, every query head: acc read and written once */
        const float *v0 = v_cache + (slots[t] * hkv + h) * dv, *v1 = v_cache + (slots[t + 1] * hkv + h) * dv;
        const float *v2 = v_cache + (slots[t + 2] * hkv + h) * dv, *v3 = v_cache + (slots[t + 3] * hkv + h) * dv;
        for (long j = 0; j < g; j++) {
            if (lims && lims[j] <= t) continue;
            if (lims && lims[j] < t + 4) { /* this query's last keys: past them, its last key's row */
                const float *rows[4] = {v0, v1, v2, v3};
                const long e = lims[j] - 1 - t;
                accumulate4(logits + j * BLOCK + t, rows[0], rows[1 < e ? 1 : e], rows[2 < e ? 2 : e], rows[3 < e ? 3 : e],
                            acc + j * dv, dv);
                continue;
            }
            accumulate4(logits + j * BLOCK + t, v0, v1, v2, v3, acc + j * dv, dv);
        }
        ahead_lines(ahead);
        ahead_lines(block_ahead);
    }
}

/* The slots of a block's n logical positions, walking a block-table row from (``*page_idx``,
 * ``*offset``) on (no division per key), padded to a multiple of 4 by repeating the last one (a
 * written row). Returns -1, or t of the first position on a released page or one outside the pool
 * (the walk stops there, nothing of it read). */
static inline long block_slots(const long *pages, long *page_idx, long *offset, long n, long page_size,
                               long num_pages, long *slots) {
    for (long t = 0; t < n; t++) {
        const long page = pages[*page_idx];
        if (page < 0 || page >= num_pages) return t;
        slots[t] = page * page_size + *offset;
        if (++*offset == page_size) {
            *offset = 0;
            ++*page_idx;
        }
    }
    for (long t = n; t < (n + 3) / 4 * 4; t++) slots[t] = slots[n - 1];
    return -1;
}

/* One query's output from its online-softmax state: acc / (l + e^(sink - m)), the sink (NULL: none)
 * joining the denominator only; no visible key gives zeros, as the reference. */
static inline void finish_query(const float *acc, float l, float m, const float *sink, float *out, long dv) {
    float denom = l;
    if (sink) denom += expf(*sink - m);
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
#pragma omp simd
    for (long d = 0; d < dv; d++) out[d] = acc[d] * inv;
}

/* One request: keys [first, len) through its block-table row ``pages``; q [hq, dqk] (scaled), out
 * [hq, dv]. Returns 0, or pos + 1 for the first visible position on a released page or one outside
 * the pool (nothing of it read). */
static long attend_request(const float *qs, const float *k_cache, const float *v_cache, const long *pages,
                           long page_size, long num_pages, long first, long len, long hq, long hkv, long dqk,
                           long dv, const float *sinks, float *out, float *logits, float *acc, float *m, float *l,
                           const long *next_pages, long next_first, long next_len, Ahead *ahead, int whole) {
    long g = hq / hkv;
    for (long j = 0; j < hq; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, (size_t)(hq * dv) * sizeof(float));
    long slots[BLOCK];
    long page_idx = first / page_size, offset = first % page_size; /* walk pages: no division per key */
    for (long start = first; start < len; start += BLOCK) {
        long n = len - start < BLOCK ? len - start : BLOCK;
        const long bad = block_slots(pages, &page_idx, &offset, n, page_size, num_pages, slots);
        if (bad >= 0) return start + bad + 1; /* released / outside the pool */
#ifdef PAGED_DECODE_BURST_AHEAD
        Ahead *block_ahead = NULL;
        (void)whole;
        if (start + BLOCK < len) /* the next block while this one computes */
            prefetch_positions(k_cache, v_cache, pages, page_size, num_pages, start + BLOCK,
                               start + 2 * BLOCK < len ? start + 2 * BLOCK : len, hkv * dqk, hkv * dv);
        else if (next_pages) /* the last block: the next request's first */
            prefetch_positions(k_cache, v_cache, next_pages, page_size, num_pages, next_first,
                               next_first + BLOCK < next_len ? next_first + BLOCK : next_len, hkv * dqk, hkv * dv);
#else
        /* the next block while this one computes (not for a request asked for whole: already on its
         * way), or at the last block the next request's first, spread over this block's loops */
        Ahead block, *block_ahead = NULL;
        const long calls = 2 * hkv * ((n + 3) / 4); /* this block's ahead_lines calls */
        if (start + BLOCK < len && !whole) {
            ahead_init(&block, k_cache, v_cache, pages, page_size, num_pages, start + BLOCK,
                       start + 2 * BLOCK < len ? start + 2 * BLOCK : len, hkv * dqk, hkv * dv, calls);
            block_ahead = &block;
        } else if (start + BLOCK >= len && next_pages) {
            ahead_init(&block, k_cache, v_cache, next_pages, page_size, num_pages, next_first,
                       next_first + BLOCK < next_len ? next_first + BLOCK : next_len, hkv * dqk, hkv * dv, calls);
            block_ahead = &block;
        }
#endif
        for (long h = 0; h < hkv; h++)
            attend_block(qs + h * g * dqk, g, k_cache, v_cache, hkv, h, dqk, dv, slots, n, NULL, logits,
                         acc + h * g * dv, m + h * g, l + h * g, ahead, block_ahead);
    }
    for (long j = 0; j < hq; j++) finish_query(acc + j * dv, l[j], m[j], sinks ? sinks + j : NULL, out + j * dv, dv);
    return 0;
}

/* Rows of one request sharing their first visible key (an MTP verify step's 1 + k rows, a short prefill
 * chunk over full attention: row r has context len0 + r, keys [first, len0 + r)). Each row alone
 * reads every key of the context again, and beside a small head that read is the cost (29 rows over
 * ~1,100 keys, 8 heads of 24: ~1.1 MB of K/V per row); here the keys go by once, block by block, for
 * all R x g queries of each KV head, each query masked to its own keys (attend_block's ``lims``),
 * so every row's output is the one it computes alone, bit for bit. */
#ifndef GROUP_MAX /* rows per group (-DGROUP_MAX=1: none, for A/B runs); attend_group's scratch is */
#define GROUP_MAX 64 /* R x hq x (dqk + dv + 2) + R x g x BLOCK floats */
#endif

/* How many rows from i on (at most hi - i) are one request's run: consecutive lengths over the same
 * pages (a multi-token request's rows; decode rows of other requests read other pages). */
static long run_rows(const long *table, long table_cols, const long *seq_lens, const long *req, long i, long hi,
                     long page_size) {
    const long len0 = seq_lens[req[i]];
    const long *p0 = table + req[i] * table_cols;
    long r = 1;
    while (i + r < hi) {
        const long len = seq_lens[req[i + r]];
        if (len != len0 + r) break;
        const long *pr = table + req[i + r] * table_cols;
        if (pr != p0 && memcmp(pr, p0, (size_t)((len - 1) / page_size + 1) * sizeof(long))) break;
        r++;
    }
    return r;
}

/* How many rows from i on (at most hi - i, GROUP_MAX) form a group with row i: a run's rows with the
 * same first visible key (no window, or a window none of them has filled). */
static long group_rows(const long *table, long table_cols, const long *seq_lens, const long *req, long i, long hi,
                       long window, long page_size) {
    const long len0 = seq_lens[req[i]];
    if (window > 0 && len0 > window) return 1; /* each row's window starts on its own key */
    long r = run_rows(table, table_cols, seq_lens, req, i, hi - i < GROUP_MAX ? hi : i + GROUP_MAX, page_size);
    if (window > 0 && r > window - len0 + 1) r = window - len0 + 1; /* rows up to length window */
    return r;
}

/* The group of rows [i, i + R) (group_rows): q rows q_row[i + r], outputs as decode_range's. Returns
 * 0, -1 out of memory, or 1 with error[0] = the first row a single-row walk would find failing and
 * error[1] its position (the lowest released / outside page: row 0 reaches it unless it lies past
 * row 0's keys, then the first row whose keys include it). */
static long attend_group(const float *q, long q_stride, const long *q_row, long R, const float *k_cache,
                         const float *v_cache, const long *pages, long page_size, long num_pages, long len0, long hq,
                         long hkv, long dqk, long dv, const float *sinks, float scale, float *out, long out_stride,
                         long *error) {
    const long g = hq / hkv, G = R * g, end = len0 + R - 1; /* keys [0, end): the last row's */
    float *scratch = malloc((size_t)(hkv * G * (dqk + dv + 2) + G * BLOCK) * sizeof(float));
    long *lims = malloc((size_t)G * sizeof(long));
    if (!scratch || !lims) {
        free(scratch);
        free(lims);
        return -1;
    }
    float *qs = scratch, *acc = qs + hkv * G * dqk, *m = acc + hkv * G * dv, *l = m + hkv * G, *logits = l + hkv * G;
    for (long h = 0; h < hkv; h++) /* KV head h's queries: row r's heads h g .. h g + g - 1 at r g + j */
        for (long r = 0; r < R; r++)
            for (long j = 0; j < g; j++) {
                const float *src = q + q_row[r] * q_stride + (h * g + j) * dqk;
                float *dst = qs + (h * G + r * g + j) * dqk;
                for (long e = 0; e < dqk; e++) dst[e] = src[e] * scale;
            }
    for (long j = 0; j < hkv * G; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, (size_t)(hkv * G * dv) * sizeof(float));
    long slots[BLOCK], status = 0;
    long page_idx = 0, offset = 0;
    for (long start = 0; start < end && !status; start += BLOCK) {
        const long n = end - start < BLOCK ? end - start : BLOCK;
        const long bad = block_slots(pages, &page_idx, &offset, n, page_size, num_pages, slots);
        if (bad >= 0) { /* position start + bad: row 0's, or the first row's that has it */
            const long pos = start + bad;
            error[0] = pos < len0 ? 0 : pos - len0 + 1;
            error[1] = pos;
            status = 1;
            break;
        }
        for (long r = 0; r < R; r++) {
            const long seen = len0 + r - start, lim = seen < n ? (seen > 0 ? seen : 0) : n;
            for (long j = 0; j < g; j++) lims[r * g + j] = lim;
        }
        for (long h = 0; h < hkv; h++)
            attend_block(qs + h * G * dqk, G, k_cache, v_cache, hkv, h, dqk, dv, slots, n, lims, logits,
                         acc + h * G * dv, m + h * G, l + h * G, NULL, NULL);
    }
    for (long h = 0; h < hkv && !status; h++) /* as attend_request's end, per row */
        for (long r = 0; r < R; r++)
            for (long j = 0; j < g; j++) {
                const long x = h * G + r * g + j, head = h * g + j;
                finish_query(acc + x * dv, l[x], m[x], sinks ? sinks + head : NULL, out + q_row[r] * out_stride + head * dv,
                             dv);
            }
    free(scratch);
    free(lims);
    return status;
}

/* A run of one request's rows longer than the call's chunk_after (a prefill chunk: a question after a
 * prefix-cache hit over a long full-attention context) goes through its keys as a chunk: the keys of
 * a block transposed once per KV head and its V rows copied side by side, each query's logits then a
 * BLOCK-wide sum of dqk vector FMAs (no horizontal sums; two heads of a group sharing each load), its
 * online-softmax update on whole vectors, and p V over partial sums (independent FMA chains). The rows' bits are
 * not those of single rows (another summation order: shorter runs -- an MTP verify step's 1 + k
 * rows -- keep attend_group, whose are), but each query's are its own: blocks lie at absolute
 * multiples of BLOCK and a query takes only its own keys of each, so a row computes the same whatever
 * rows or thread ranges it goes with. Where it pays (head sizes, windows): kernels/cpu/attention_plan.py
 * NATIVE_CHUNK_HEAD_DIM. */
#define CHUNK_ROWS 32 /* rows per pass over their keys: their queries' state (R x hq x (dqk + dv + 2)) stays in L2 */
#define KEY_VECS (BLOCK / VL)
#if VL == 16
#define DEPTH_SPLIT 4 /* independent accumulator sets over the head dims: 8 FMA chains at either width */
#else
#define DEPTH_SPLIT 2
#endif

/* first visible key of a row of context len */
static inline long key_first(long len, long window) { return window > 0 && len > window ? len - window : 0; }

/* nq (1 or 2) queries of one row against one block: the logits of all BLOCK keys (kt: the block's keys
 * for this KV head, [dqk][BLOCK]), then over the row's keys [tlo, thi) of the block each query's
 * online-softmax update of m / l / acc and acc += p V (vrow[t]: key t's V row). Two
 * queries (two heads of one KV head's group) share every K and V load; their sums split over half as
 * many partial chains, so a head's bits depend on nq, which depends only on the head's place in its
 * group (attend_chunk), never on the rows or threads beside it. */
static inline __attribute__((always_inline)) void chunk_queries(const int nq, const float *const *qv, const float *kt,
                                                                 const float *const *vrow, long dqk, long dv, long tlo,
                                                                 long thi, float *s, float *const *acc, float *m,
                                                                 float *l) {
    const int depth = DEPTH_SPLIT / nq, parts = 4 / nq; /* 8 FMA chains either way */
    vf c[2][DEPTH_SPLIT][KEY_VECS];
    for (int q = 0; q < nq; q++)
        for (int p = 0; p < depth; p++)
            for (int u = 0; u < KEY_VECS; u++) c[q][p][u] = (vf){0};
    long d = 0;
    for (; d + depth <= dqk; d += depth)
        for (int p = 0; p < depth; p++)
            for (int u = 0; u < KEY_VECS; u++) {
                const vf k = load(kt + (d + p) * BLOCK + u * VL);
                for (int q = 0; q < nq; q++) c[q][p][u] += qv[q][d + p] * k;
            }
    for (; d < dqk; d++)
        for (int u = 0; u < KEY_VECS; u++) {
            const vf k = load(kt + d * BLOCK + u * VL);
            for (int q = 0; q < nq; q++) c[q][0][u] += qv[q][d] * k;
        }
    for (int q = 0; q < nq; q++) {
        /* the logits of its keys; the block's other places -inf, so they weigh e^-inf = 0 */
        vf x[KEY_VECS], top = (vf){0} - INFINITY;
        for (int u = 0; u < KEY_VECS; u++) {
            vf sum = c[q][0][u];
            for (int p = 1; p < depth; p++) sum += c[q][p][u];
            const vi at = lane_index() + u * VL, mine = (at >= (int)tlo) & (at < (int)thi);
            x[u] = (vf)(((vi)sum & mine) | ((vi)((vf){0} - INFINITY) & ~mine));
            const vi above = top > x[u];
            top = (vf)(((vi)top & above) | ((vi)x[u] & ~above));
        }
        float mb = m[q];
        for (int t = 0; t < VL; t++) mb = top[t] > mb ? top[t] : mb;
        vf total = (vf){0};
        for (int u = 0; u < KEY_VECS; u++) {
            const vf p = exp_nonpositive_v(x[u] - mb);
            store(s + q * BLOCK + u * VL, p);
            total += p;
        }
        float sum = 0.0f;
        for (int t = 0; t < VL; t++) sum += total[t];
        if (mb != m[q]) { /* a new running max: rescale what was summed under the old one */
            const float alpha = exp_approx(m[q] - mb); /* m = -inf (first block): 0 */
            l[q] *= alpha;
            float *a = acc[q];
#pragma omp simd
            for (long e = 0; e < dv; e++) a[e] *= alpha;
            m[q] = mb;
        }
        l[q] += sum;
    }
    long e = 0;
    for (; e + 2 * VL <= dv; e += 2 * VL) { /* two vectors of each acc, partial sums over the keys */
        vf a[2][4][2];
        for (int q = 0; q < nq; q++)
            for (int p = 0; p < parts; p++) a[q][p][0] = a[q][p][1] = (vf){0};
        long t = tlo;
        for (; t + parts <= thi; t += parts)
            for (int p = 0; p < parts; p++) {
                const vf v0 = load(vrow[t + p] + e), v1 = load(vrow[t + p] + e + VL);
                for (int q = 0; q < nq; q++) {
                    a[q][p][0] += s[q * BLOCK + t + p] * v0;
                    a[q][p][1] += s[q * BLOCK + t + p] * v1;
                }
            }
        for (; t < thi; t++)
            for (int q = 0; q < nq; q++) {
                a[q][0][0] += s[q * BLOCK + t] * load(vrow[t] + e);
                a[q][0][1] += s[q * BLOCK + t] * load(vrow[t] + e + VL);
            }
        for (int q = 0; q < nq; q++)
            for (int w = 0; w < 2; w++) {
                vf sum = a[q][0][w];
                for (int p = 1; p < parts; p++) sum += a[q][p][w];
                store(acc[q] + e + w * VL, load(acc[q] + e + w * VL) + sum);
            }
    }
    for (; e + VL <= dv; e += VL) {
        vf a[2][4];
        for (int q = 0; q < nq; q++)
            for (int p = 0; p < parts; p++) a[q][p] = (vf){0};
        long t = tlo;
        for (; t + parts <= thi; t += parts)
            for (int p = 0; p < parts; p++) {
                const vf v0 = load(vrow[t + p] + e);
                for (int q = 0; q < nq; q++) a[q][p] += s[q * BLOCK + t + p] * v0;
            }
        for (; t < thi; t++)
            for (int q = 0; q < nq; q++) a[q][0] += s[q * BLOCK + t] * load(vrow[t] + e);
        for (int q = 0; q < nq; q++) {
            vf sum = a[q][0];
            for (int p = 1; p < parts; p++) sum += a[q][p];
            store(acc[q] + e, load(acc[q] + e) + sum);
        }
    }
    for (; e < dv; e++)
        for (int q = 0; q < nq; q++) {
            float a = 0.0f;
            for (long t = tlo; t < thi; t++) a += s[q * BLOCK + t] * vrow[t][e];
            acc[q][e] += a;
        }
}

/* The run of rows [0, R) of one request (row r: context len0 + r, keys [key_first(len0 + r), len0 + r)),
 * CHUNK_ROWS at a time: q rows q_row[r], outputs as decode_range's. Returns 0, -1 out of memory, or 1
 * with error[0] = the first row a single-row walk would find failing and error[1] its position (the
 * lowest released / outside page of the pass's keys: the first row whose keys include it). */
static long attend_chunk(const float *q, long q_stride, const long *q_row, long R, const float *k_cache,
                         const float *v_cache, const long *pages, long page_size, long num_pages, long len0,
                         long window, long hq, long hkv, long dqk, long dv, const float *sinks, float scale,
                         float *out, long out_stride, long *error) {
    const long g = hq / hkv, per = (R < CHUNK_ROWS ? R : CHUNK_ROWS) * hq; /* queries of a pass */
    float *scratch = malloc((size_t)(per * (dqk + dv + 2) + (dqk + dv + 2) * BLOCK) * sizeof(float));
    if (!scratch) return -1;
    float *qs = scratch, *acc = qs + per * dqk, *m = acc + per * dv, *l = m + per, *kt = l + per, *vb = kt + dqk * BLOCK;
    float *s = vb + dv * BLOCK; /* two queries' p of a block */
    const float *vrow[BLOCK];
    long slots[BLOCK], status = 0;
    for (long a = 0; a < R && !status; a += CHUNK_ROWS) {
        const long b = a + CHUNK_ROWS < R ? a + CHUNK_ROWS : R, n = (b - a) * hq;
        for (long r = a; r < b; r++) { /* query (r, head) at (r - a) hq + head */
            const float *src = q + q_row[r] * q_stride;
            float *dst = qs + (r - a) * hq * dqk;
            for (long e = 0; e < hq * dqk; e++) dst[e] = src[e] * scale;
        }
        for (long x = 0; x < n; x++) {
            m[x] = -INFINITY;
            l[x] = 0.0f;
        }
        memset(acc, 0, (size_t)(n * dv) * sizeof(float));
        const long lo = key_first(len0 + a, window), hi = len0 + b - 1; /* the pass's keys [lo, hi) */
        for (long start = lo / BLOCK * BLOCK; start < hi && !status; start += BLOCK) {
            const long klo = start > lo ? start : lo, khi = start + BLOCK < hi ? start + BLOCK : hi;
            for (long pos = klo; pos < khi; pos++) {
                const long page = pages[pos / page_size];
                if (page < 0 || page >= num_pages) { /* the first row whose keys include it */
                    error[0] = pos - len0 + 1 > a ? pos - len0 + 1 : a;
                    error[1] = pos;
                    status = 1;
                    break;
                }
                slots[pos - start] = page * page_size + pos % page_size;
            }
            if (status) break;
            /* the block's other places hold one of its keys: read, never taken */
            for (long t = 0; t < klo - start; t++) slots[t] = slots[klo - start];
            for (long t = khi - start; t < BLOCK; t++) slots[t] = slots[khi - start - 1];
            for (long h = 0; h < hkv; h++) {
                /* the block's K transposed and its V rows side by side, read by every query of the pass:
                 * in the pool one head's rows lie hkv x dv floats apart, and at large heads (64 x 128)
                 * that stride maps a block's V rows onto a few L1 sets, so each query fetched them again */
                for (long t = 0; t < BLOCK; t++) {
                    const float *k = k_cache + (slots[t] * hkv + h) * dqk;
                    for (long e = 0; e < dqk; e++) kt[e * BLOCK + t] = k[e];
                    memcpy(vb + t * dv, v_cache + (slots[t] * hkv + h) * dv, (size_t)dv * sizeof(float));
                    vrow[t] = vb + t * dv;
                }
                for (long r = a; r < b; r++) {
                    const long len = len0 + r, first = key_first(len, window);
                    const long tlo = (first > klo ? first : klo) - start, thi = (len < khi ? len : khi) - start;
                    if (tlo >= thi) continue; /* none of its keys in this block */
                    for (long j = 0; j < g; j += 2) { /* the group's heads in pairs (an odd last one alone) */
                        const long x = (r - a) * hq + h * g + j;
                        const float *qv[2] = {qs + x * dqk, qs + (x + 1) * dqk};
                        float *ac[2] = {acc + x * dv, acc + (x + 1) * dv};
                        if (j + 1 < g) chunk_queries(2, qv, kt, vrow, dqk, dv, tlo, thi, s, ac, m + x, l + x);
                        else chunk_queries(1, qv, kt, vrow, dqk, dv, tlo, thi, s, ac, m + x, l + x);
                    }
                }
            }
        }
        for (long r = a; r < b && !status; r++)
            for (long head = 0; head < hq; head++) {
                const long x = (r - a) * hq + head;
                finish_query(acc + x * dv, l[x], m[x], sinks ? sinks + head : NULL,
                             out + q_row[r] * out_stride + head * dv, dv);
            }
    }
    free(scratch);
    return status;
}

/* Rows [lo, hi) of paged_decode_attention, one after the other with their own scratch (the
 * prefetches chain from row to row); same statuses, error[0] a row index of the whole call. */
static long decode_range(const float *q, long q_stride, const float *k_cache, const float *v_cache,
                         long num_slots, const long *table, long table_cols, const long *seq_lens,
                         const long *req, const long *q_row, long lo, long hi, const float *sinks, float *out,
                         long out_stride, long hq, long hkv, long dqk, long dv, long page_size, long window,
                         float scale, const long *run_end, long *error) {
    long g = hq / hkv;
    long num_pages = num_slots / page_size;
    float *scratch = malloc((size_t)(g * BLOCK + hq * (dv + dqk + 2)) * sizeof(float));
    if (!scratch) return -1;
    float *logits = scratch, *acc = logits + g * BLOCK, *qs = acc + hq * dv, *m = qs + hq * dqk, *l = m + hq;
    long status = 0;
    int whole = 0; /* this request's K/V asked for whole while the one before computed */
    for (long i = lo; i < hi; i++) {
        /* a chunk's rows (mark_chunks) up to the range's end, or a group of rows sharing their keys */
        const int chunk = run_end && run_end[i];
        const long r = chunk ? (run_end[i] < hi ? run_end[i] : hi) - i
                             : group_rows(table, table_cols, seq_lens, req, i, hi, window, page_size);
        if (chunk || r > 1) {
            if (!chunk && i + r < hi) { /* the next row's first keys while the group computes */
                const long nlen = seq_lens[req[i + r]], nfirst = key_first(nlen, window);
                prefetch_positions(k_cache, v_cache, table + req[i + r] * table_cols, page_size, num_pages, nfirst,
                                   nfirst + BLOCK < nlen ? nfirst + BLOCK : nlen, hkv * dqk, hkv * dv);
            }
            long e[2] = {0, 0};
            const long *pages = table + req[i] * table_cols, len0 = seq_lens[req[i]];
            const long st = chunk ? attend_chunk(q, q_stride, q_row + i, r, k_cache, v_cache, pages, page_size, num_pages,
                                                 len0, window, hq, hkv, dqk, dv, sinks, scale, out, out_stride, e)
                                  : attend_group(q, q_stride, q_row + i, r, k_cache, v_cache, pages, page_size, num_pages,
                                                 len0, hq, hkv, dqk, dv, sinks, scale, out, out_stride, e);
            if (st) {
                status = st;
                if (st > 0) {
                    error[0] = i + e[0];
                    error[1] = e[1];
                }
                break;
            }
            whole = 0;
            i += r - 1;
            continue;
        }
        long len = seq_lens[req[i]];
        long first = key_first(len, window);
        const long *pages = table + req[i] * table_cols;
        if (i == lo)
            prefetch_positions(k_cache, v_cache, pages, page_size, num_pages, first,
                               first + BLOCK < len ? first + BLOCK : len, hkv * dqk, hkv * dv);
        const long *next_pages = NULL;
        long next_first = 0, next_len = 0;
        Ahead ahead;
        int use_ahead = 0;
        if (i + 1 < hi) {
            next_pages = table + req[i + 1] * table_cols;
            next_len = seq_lens[req[i + 1]];
            next_first = key_first(next_len, window);
            if ((next_len - next_first) * hkv * (dqk + dv) * (long)sizeof(float) <= WHOLE_AHEAD) {
                /* a short context: all of the next request's rows, a whole request of compute ahead
                 * of their use (a block ahead left the K/V of a decode step waiting on memory) */
#ifdef PAGED_DECODE_BURST_AHEAD
                prefetch_positions(k_cache, v_cache, next_pages, page_size, num_pages, next_first, next_len,
                                   hkv * dqk, hkv * dv);
#else
                const long calls = 2 * hkv * ((len - first + 3) / 4); /* this request's ahead_lines calls */
                ahead_init(&ahead, k_cache, v_cache, next_pages, page_size, num_pages, next_first, next_len,
                           hkv * dqk, hkv * dv, calls);
                use_ahead = 1;
#endif
                next_pages = NULL;
            }
        }
        const float *qi = q + q_row[i] * q_stride;
        for (long e = 0; e < hq * dqk; e++) qs[e] = qi[e] * scale;
        long bad = attend_request(qs, k_cache, v_cache, pages, page_size, num_pages, first, len, hq, hkv, dqk, dv,
                                  sinks, out + q_row[i] * out_stride, logits, acc, m, l, next_pages, next_first,
                                  next_len, use_ahead ? &ahead : NULL, whole);
        whole = use_ahead;
        if (bad) {
            error[0] = i;
            error[1] = bad - 1;
            status = 1;
            break;
        }
    }
    free(scratch);
    return status;
}

/* The first row of share ``part`` of ``parts``: a split call's rows go to the team's threads at equal
 * shares of their visible keys (``keys``: all of them), not of their count -- a causal chunk's later
 * rows see more keys than its first, a long context's decode row more than a short one's. */
static long share_start(const long *seq_lens, const long *req, long num_rows, long window, long keys, long part,
                        long parts) {
    if (part >= parts) return num_rows;
    const long want = keys * part / parts;
    long seen = 0;
    for (long i = 0; i < num_rows; i++) {
        if (seen >= want) return i;
        const long len = seq_lens[req[i]];
        seen += len - key_first(len, window);
    }
    return num_rows;
}

/* run_end[i] = the end of row i's run (run_rows) when the run goes as a chunk (attend_chunk: more
 * than chunk_after rows; chunk_after 0: none does), else 0. Decided over the whole call, so a row
 * takes the same path whichever thread's range it falls in. NULL when no run qualifies (or out of
 * memory: the rows then walk as single rows and groups, the same results to fp32 rounding). */
static long *mark_chunks(const long *table, long table_cols, const long *seq_lens, const long *req, long num_rows,
                         long page_size, long chunk_after) {
    if (chunk_after <= 0 || num_rows <= chunk_after) return NULL;
    long *run_end = NULL;
    for (long i = 0; i < num_rows;) {
        const long r = run_rows(table, table_cols, seq_lens, req, i, num_rows, page_size);
        if (r > chunk_after) {
            if (!run_end && !(run_end = calloc((size_t)num_rows, sizeof(long)))) return NULL;
            for (long x = i; x < i + r; x++) run_end[x] = i + r;
        }
        i += r;
    }
    return run_end;
}

/* All decode rows of one layer. Row i: request req[i] (its block-table row and seq_lens entry),
 * query q[q_row[i]] ([hq, dqk] at q + q_row[i] * q_stride), output out[q_row[i]] ([hq, dv] at
 * out + q_row[i] * out_stride). window <= 0: no window. sinks: [hq] or NULL.
 * Returns 0; 1 when a visible position maps to a released page or one outside the pool, 2 when a
 * context is longer than the block table's row (error[0] = row i, error[1] = position; nothing
 * further is read); -1 when the scratch memory cannot be allocated.
 * Built with OpenMP (the runtime torch loaded: kernels/native/build.py), a call of at least
 * PARALLEL_ROWS rows, or of at least SPLIT_MACS multiply-adds (team.h), on a thread whose OpenMP
 * count is above one (the engine thread's wide step) splits the rows into one contiguous range per
 * team thread, at equal shares of their keys (share_start): every row is computed exactly as alone,
 * so the output is the same bit for bit; a failing row reported is the lowest of the ranges' first
 * failures. Rows of one request that share their keys go as one group (attend_group), within a range;
 * a run of more than chunk_after rows (0: none) as a chunk (attend_chunk), whose rows keep their bits
 * whatever the split. */
long paged_decode_attention(const float *q, long q_stride, const float *k_cache, const float *v_cache,
                            long num_slots, const long *table, long table_cols, const long *seq_lens,
                            const long *req, const long *q_row, long num_rows, const float *sinks, float *out,
                            long out_stride, long hq, long hkv, long dqk, long dv, long page_size, long window,
                            float scale, long chunk_after, long *error) {
    long keys = 0; /* visible keys summed over the rows: the call's work */
    for (long i = 0; i < num_rows; i++) { /* every length first: the prefetches below trust them */
        long len = seq_lens[req[i]];
        if (len > table_cols * page_size) {
            error[0] = i;
            error[1] = len - 1;
            return 2;
        }
        keys += len - key_first(len, window);
    }
    long *run_end = mark_chunks(table, table_cols, seq_lens, req, num_rows, page_size, chunk_after);
    long status = 0;
#ifdef _OPENMP
    if (split_on_team(num_rows) || (num_rows > 1 && split_work_on_team(keys * hq * (dqk + dv)))) { /* one row: nothing to share */
        long bad_row = num_rows, bad_pos = 0;
#pragma omp parallel
        {
            long nt = omp_get_num_threads(), me = omp_get_thread_num(), e[2] = {0, 0};
            long st = decode_range(q, q_stride, k_cache, v_cache, num_slots, table, table_cols, seq_lens, req, q_row,
                                   share_start(seq_lens, req, num_rows, window, keys, me, nt),
                                   share_start(seq_lens, req, num_rows, window, keys, me + 1, nt), sinks, out, out_stride, hq, hkv,
                                   dqk, dv, page_size, window, scale, run_end, e);
            if (st) {
#pragma omp critical(paged_decode_status)
                {
                    if (st < 0) status = -1;
                    else if (status >= 0 && e[0] < bad_row) {
                        status = st;
                        bad_row = e[0];
                        bad_pos = e[1];
                    }
                }
            }
        }
        if (status > 0) {
            error[0] = bad_row;
            error[1] = bad_pos;
        }
        free(run_end);
        return status;
    }
#endif
    status = decode_range(q, q_stride, k_cache, v_cache, num_slots, table, table_cols, seq_lens, req, q_row, 0,
                          num_rows, sinks, out, out_stride, hq, hkv, dqk, dv, page_size, window, scale, run_end, error);
    free(run_end);
    return status;
}
