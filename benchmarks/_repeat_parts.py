"""Where the pipeline benchmark's repeat request spends its time (``bench_repeat`` in pipeline.py).

The repeat request sends cached media with a new question placed before it: the encoder cache
answers every unit, the prefix cache only the template before the question, so every media row is
prefilled again. Its TTFT splits into what happens before the engine's first step for it (chat
parse, ingest through the source memo, planning, prompt rendering, hand-over to the engine thread),
the LLM steps (rows, wall, the engine thread's CPU and the cores the process used meanwhile: its
CPU over the steps' wall, ~1 when only one core worked) and the delivery of the token after the last step.
"""

from __future__ import annotations

import time


class StepRecorder:
    """Records every model step of ``engine`` (an OmniEngine) while active: wall start / end, the
    engine thread's CPU, the process's CPU, rows. Wraps the runner's ``run`` on that instance only."""

    def __init__(self, engine) -> None:
        self.runner = engine.runtime.llm.runner
        self.steps: list[tuple[float, float, float, float, int]] = []

    def __enter__(self) -> "StepRecorder":
        run = self.runner.run
        steps = self.steps

        def timed(entries, kv):
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            try:
                return run(entries, kv)
            finally:
                steps.append((t0, time.perf_counter(), time.thread_time() - c0, time.process_time() - p0,
                              sum(e.num_new_tokens for e in entries)))

        self.runner.run = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.run  # the class's method again

    def parts(self, start: float, ttft: float) -> dict[str, float]:
        """The request's parts in ms, for steps recorded since it started at ``start`` (perf_counter)
        and its first token ``ttft`` seconds later."""
        steps = [s for s in self.steps if s[0] >= start]
        if not steps:
            raise RuntimeError("no model step ran for the request")
        wall = sum(s[1] - s[0] for s in steps)
        return {"repeat_steps": len(steps), "repeat_step_rows": sum(s[4] for s in steps),
                "repeat_before_step_ms": (steps[0][0] - start) * 1e3, "repeat_step_ms": wall * 1e3,
                "repeat_step_thread_cpu_ms": sum(s[2] for s in steps) * 1e3,
                "repeat_step_cores": sum(s[3] for s in steps) / wall,
                "repeat_after_step_ms": (start + ttft - steps[-1][1]) * 1e3}


def settled_stats(engine, timeout_s: float = 2.0):
    """``engine``'s stats once the snapshot stops changing: the engine thread publishes it after the
    step that delivered the last first token, so a read right after may miss that request's counts."""
    last, deadline = engine.stats(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = engine.stats()
        if now.llm.prefix_cache_hit_tokens == last.llm.prefix_cache_hit_tokens:
            return now
        last = now
    return last
