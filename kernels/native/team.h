/* Whether a C kernel call splits its work among the calling thread's OpenMP team: one owner for the
 * rule the kernels built with OpenMP share (decoder_layer.c, moe_experts.c, paged_decode.c).
 *
 * The engine thread runs a step of its min_rows or more (measured at start: 16 where short steps pay
 * for the team, up to 256 where they do not) on its wide team while the cores are free, and every
 * other step, and every other thread, at one (mm_pipeline/runtime/cpu_threads/thread_choice.py), so "this thread's OpenMP count is above one" says "a step on free cores". A
 * call splits there when it has PARALLEL_ROWS rows (split_on_team: the kernel splits its rows), or
 * fewer rows with at least SPLIT_MACS multiply-adds (split_work_on_team: a short prefill step's
 * projections split by output columns, its experts by work items, its attention rows by range);
 * smaller calls stay on the calling thread, whose work would not pay for the fork and join. Every
 * split gives the one-thread call's bits. Built without OpenMP (kernels/native/build.py: torch
 * loaded no libgomp, or MMSERVE_NATIVE_OPENMP=0) nothing splits. */
#ifndef MMSERVE_TEAM_H
#define MMSERVE_TEAM_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PARALLEL_ROWS 64 /* rows (tokens) from which a call on a wide thread splits among its team */

static inline int split_on_team(int64_t rows) {
#ifdef _OPENMP
    return rows >= PARALLEL_ROWS && omp_get_max_threads() > 1;
#else
    (void)rows;
    return 0;
#endif
}

/* A call of fewer rows splits where its own work pays for the fork and join: at least SPLIT_MACS
 * multiply-adds, on a wide thread, not already inside a parallel region (a split call's work items
 * run their GEMMs whole). In practice a short prefill step on free cores: the ~30 rows of a question
 * after a prefix-cache hit. Measured on the 2-core host (benchmarks/repeat_step.py, the pipeline
 * benchmark's same-prefix step, 29 rows, medians of 10 alternating in place): 4.86 ms at one thread,
 * 3.88 ms on the team; per call at 29 rows (1 -> 2 threads): attention front 120 -> 77 us, out 38 ->
 * 30, dense MLP 352 -> 255, experts 283 -> 202. Below 2^19 multiply-adds (o_proj of a few rows) the
 * fork and join cost what the second core saves. */
#ifndef SPLIT_MACS
#define SPLIT_MACS (1 << 19)
#endif
static inline int split_work_on_team(int64_t macs) {
#ifdef _OPENMP
    return macs >= SPLIT_MACS && omp_get_max_threads() > 1 && !omp_in_parallel();
#else
    (void)macs;
    return 0;
#endif
}

#endif
