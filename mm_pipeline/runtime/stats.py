"""OmniStats: the omni engine at one instant -- the LLM's snapshot plus the multimodal parts.

Built by the engine thread after every iteration of :class:`EngineLoop` (after a step, and on the
idle wake-ups while nothing runs) and published by swapping one reference; ``OmniEngine.stats()``
returns the last one. HTTP threads (``/metrics``, ``/health``) read it and never touch the
scheduler, the pools or the caches.

Names follow :mod:`llm_core.engine.stats`: a field is the Prometheus name without ``mmserve_``
(counters get ``_total``); a mapping field is one family, its key the label named in the comment.
The counter maps of the encoder batcher, the encoder cache and the media planner keep their owners'
key names; a key ``a.b`` is family ``a`` with label ``kind="b"`` (mm_pipeline/server/metrics.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from llm_core.engine.stats import EngineStats, as_plain, frozen_map


@dataclass(frozen=True)
class OmniStats:
    llm: EngineStats
    requests_in_flight: int  # admitted by OmniEngine and not finished yet
    requests_in_flight_limit: int  # max_queue: one more is refused with 429
    engine_loop_requests: int  # requests the engine loop still delivers outputs to
    engine_loop: Mapping[str, int]  # counters: steps, idle_waits, encoder_units, loop_errors (+ the
    # encoder worker's encoder_runs, encoder_errors when it runs the encoder)
    encoder_cache_hits: Mapping[str, int]  # counter, label tier: memory, disk, redis
    encoder_cache_misses: int  # counter
    encoder_cache: Mapping[str, int]  # the cache's other counts (computes, joins, pending_writes...)
    encoder: Mapping[str, int]  # the encoder batcher: claims, joins, forwards.<encoder>, encoded.<kind>...
    media: Mapping[str, int]  # counters of the planner: probes, images_decoded, video_chunks_decoded...
    decode_pool_admitted: int  # media calls running or queued on the decode workers
    decode_pool_waiting: int  # media calls waiting for a worker slot
    taken_at: float  # time.monotonic() when built
    # gauge, label thread: engine, encoder -- the intra-op threads each runs at (those that set a
    # count: configured or measured at start, runtime/cpu_threads/thread_choice.py)
    intra_op_threads: Mapping[str, int] = field(default_factory=lambda: frozen_map({}))

    @classmethod
    def collect(cls, runtime: Any, requests_in_flight: int) -> "OmniStats":
        """Read ``runtime`` (an OmniRuntime); on the engine thread, whose LLM snapshot is current."""
        cache = runtime.cache.stats()
        rest = {k: v for k, v in cache.items() if k not in ("hits", "misses")}
        return cls(
            llm=runtime.llm.stats(),
            requests_in_flight=requests_in_flight,
            requests_in_flight_limit=runtime.config.max_queue,
            engine_loop_requests=runtime.loop.num_requests,
            engine_loop=frozen_map(_loop_counts(runtime)),
            encoder_cache_hits=frozen_map(cache["hits"]),
            encoder_cache_misses=cache["misses"],
            encoder_cache=frozen_map(rest),
            encoder=frozen_map(runtime.batcher.stats()),
            media=frozen_map(runtime.planner.counts),
            decode_pool_admitted=runtime.pool.admitted,
            decode_pool_waiting=runtime.pool.waiting,
            taken_at=time.monotonic(),
            intra_op_threads=frozen_map(runtime.thread_counts()),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (for JSON: ``/health``, the caption summary, benchmark reports)."""
        return as_plain(self)


def _loop_counts(runtime: Any) -> dict[str, int]:
    """The engine loop's counters; with the encoder on its own worker, encoder units are counted
    there (one family either way)."""
    counts = dict(runtime.loop.counts)
    steps = getattr(runtime.loop, "step_threads", None)
    if steps is not None:  # long steps at the engine's team / kept at one thread (thread_choice.StepThreads)
        counts.update(steps.counts)
    worker = getattr(runtime, "encoder_worker", None)
    if worker is not None:
        for name, value in worker.counts.items():
            counts[name] = counts.get(name, 0) + value
    return counts
