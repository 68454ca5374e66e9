"""``WorkerPool.busy``: the decode workers using a CPU. A worker waiting for room in the decode
budget uses none, so the encoder's intra-op share (which follows the busy decode workers) must not
give its core up to it: the encoder's progress is what frees the budget. ``admitted`` (what the
share followed before) counts such a worker, and queued calls too."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

from mm_pipeline.media.decode.budget import DecodeBudget, DecodeControl
from mm_pipeline.media.worker_pool import WorkerPool, blocked
from mm_pipeline.runtime.encoder_worker import free_cpu_threads


async def _until(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Until ``condition()`` holds (a state the worker threads reach), failing after ``limit_s``."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        await asyncio.sleep(0.001)


def test_a_worker_waiting_for_the_decode_budget_is_not_busy() -> None:
    pool = WorkerPool(2, 4)
    budget = DecodeBudget(100)
    decoding, finish = threading.Event(), threading.Event()

    def decode() -> None:  # stands for a decode on the CPU
        decoding.set()
        finish.wait(30)

    def reserve() -> int:
        with budget.reserve(60, DecodeControl(30.0)):
            return budget.in_use

    async def main() -> None:
        with budget.reserve(50):  # no room for the second call's 60 yet
            running = asyncio.ensure_future(pool.run(decode))
            waiting = asyncio.ensure_future(pool.run(reserve))
            await _until(lambda: decoding.is_set() and budget.waiting == 1, "one decodes, one waits")
            assert pool.admitted == 2  # before: both counted busy
            assert pool.busy == 1
            # the runtime's encoder share on 4 CPUs (runtime/components.py follows the pool this way)
            assert free_cpu_threads(4, lambda: pool.busy)() == 3
            pool.check_integrity()
        assert await waiting == 60  # room again: it reserves, and is busy while it runs
        assert pool.busy == 1
        finish.set()
        await running
        await _until(lambda: pool.busy == 0, "both calls returned")

    try:
        asyncio.run(main())
    finally:
        finish.set()
        pool.shutdown()
    pool.check_integrity()


def test_blocked_is_per_pool_and_a_no_op_off_the_pool() -> None:
    with blocked():  # the test's own thread runs no pool's call
        pass
    a, b = WorkerPool(1, 1), WorkerPool(1, 1)

    def inside() -> tuple[int, int]:
        with blocked():
            return a.busy, b.busy

    try:
        assert asyncio.run(a.run(inside)) == (0, 0)
        assert (a.busy, b.busy) == (0, 0)
    finally:
        a.shutdown()
        b.shutdown()
