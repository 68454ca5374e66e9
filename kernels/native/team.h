/* Whether a C kernel call splits its work among the calling thread's OpenMP team: one owner for the
 * rule the kernels built with OpenMP share (decoder_layer.c, moe_experts.c, paged_decode.c).
 *
 * The engine thread runs a long step on its wide team and every other step, and every other thread,
 * at one (mm_pipeline/runtime/thread_choice.py), so "this thread's OpenMP count is above one" says
 * "a long step on free cores". A call of fewer than PARALLEL_ROWS rows stays on the calling thread
 * even there: its work would not pay for the team's fork and join. Built without OpenMP
 * (kernels/native/build.py: torch loaded no libgomp, or MMSERVE_NATIVE_OPENMP=0) nothing splits. */
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

#endif
