"""The worker pool is fair between flows (requests): a free worker starts a call of the flow with the
fewest calls running (among equals the one served longest ago), and a spare thread starts only a
flow that has none running -- so a request's few calls never queue behind the dozens one long video
queued before it. Liveness: every call runs (or is cancelled) whatever the interleaving."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.errors import ServerBusy
from mm_pipeline.media.flows import flow
from mm_pipeline.media.worker_pool import WorkerPool

LIMIT_S = 30.0  # any wait here is a hang, not a slow machine


class Calls:
    """Pool calls that note the order they start in; a call whose name ``held`` maps to a gate waits
    for it (a decode holding its worker)."""

    def __init__(self, held: dict[str, threading.Event] | None = None) -> None:
        self.held = held or {}
        self.order: list[str] = []

    def __call__(self, name: str) -> str:
        self.order.append(name)
        if name in self.held:
            self.held[name].wait(LIMIT_S)
        return name

    def release(self) -> None:
        for gate in self.held.values():
            gate.set()


async def until(condition, what: str = "the pool's threads to get there") -> None:
    """Until ``condition()`` holds (a state the worker threads reach), failing after LIMIT_S."""
    end = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        await asyncio.sleep(0.001)


def _checked(pool: WorkerPool, violations: list[str]) -> None:
    """Check every start decision where it is made (under the pool's lock): never more than
    ``max_workers + spare`` started, a spare start only for a flow with none running, and the
    chosen flow one of the most urgent priority, then the fewest calls running, of those waiting
    (on a spare thread: of those with none running)."""
    take = pool._take

    def checked():
        started = pool._started
        state = {k: (f.priority, f.started) for k, f in pool._flows.items()}
        call = take()
        if call is None:
            return None
        spare = started >= pool.max_workers
        if started >= pool.max_workers + pool.spare:
            violations.append(f"started a call with {started} already started")
        if spare and state[call.flow][1]:
            violations.append(f"spare start for flow {call.flow!r} with {state[call.flow][1]} running")
        eligible = [state[k] for k in [*pool._ready, call.flow] if not (spare and state[k][1])]
        if state[call.flow] != min(eligible):
            violations.append(f"flow {call.flow!r} {state[call.flow]} chosen over {eligible}")
        return call

    pool._take = checked


def test_a_newcomer_runs_before_the_queue_of_a_flow_that_had_its_turn() -> None:
    pool = WorkerPool(1, 16)
    call = Calls({"v1": threading.Event()})

    async def main() -> None:
        with flow("video"):
            video = [asyncio.create_task(pool.run(call, f"v{i}")) for i in range(1, 5)]
        await until(lambda: call.order == ["v1"])
        with flow("image"):
            image = asyncio.create_task(pool.run(call, "i1"))
        await until(lambda: pool.admitted >= 5)
        call.release()
        assert await asyncio.wait_for(asyncio.gather(*video, image), LIMIT_S) == ["v1", "v2", "v3", "v4", "i1"]

    try:
        asyncio.run(main())
    finally:
        call.release()
        pool.shutdown()
    # v1 ran alone; then the image (never served) before the video's queue, which then runs in order
    assert call.order == ["v1", "i1", "v2", "v3", "v4"]
    pool.check_integrity()


def test_the_spare_thread_serves_a_newcomer_while_one_flow_holds_every_worker() -> None:
    pool = WorkerPool(2, 16, spare=1)
    violations: list[str] = []
    _checked(pool, violations)
    gate = threading.Event()

    def chunk(i: int) -> int:  # stands for a video chunk decode
        gate.wait(LIMIT_S)
        return i

    async def main() -> None:
        with flow("video"):
            video = [asyncio.create_task(pool.run(chunk, i)) for i in range(6)]
        await until(lambda: pool.busy >= 2 and pool.admitted >= 6)
        await asyncio.sleep(0.02)
        assert pool.busy == 2  # the video's 4 other chunks never take the spare
        with flow("image"):  # its calls, one after another, each on the spare thread
            for step in ("ingest", "plan", "decode"):
                assert await asyncio.wait_for(pool.run(lambda s=step: s), LIMIT_S) == step
        assert not any(t.done() for t in video)
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*video), LIMIT_S) == list(range(6))

    try:
        asyncio.run(main())
    finally:
        gate.set()
        pool.shutdown()
    assert violations == []
    pool.check_integrity()
    assert not pool._flows and not pool._ready


def test_calls_outside_any_flow_share_one_fifo() -> None:
    pool = WorkerPool(1, 16)
    order: list[int] = []

    async def main() -> None:
        await asyncio.gather(*(pool.run(lambda i=i: order.append(i)) for i in range(8)))

    asyncio.run(main())
    pool.shutdown()
    assert order == list(range(8))


@settings(max_examples=40, deadline=None)
@given(workers=st.integers(1, 3), spare=st.integers(0, 2), pending=st.integers(0, 6),
       calls=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.booleans()), min_size=1, max_size=24),
       seed=st.integers(0, 2**16))
def test_every_call_runs_once_and_every_start_is_fair(workers, spare, pending, calls, seed) -> None:
    """Random flows (None among them) of two priorities, durations and cancellations: each call not
    cancelled returns its own value, exactly once; every start decision obeys the rules; nothing is
    left counted."""
    pool = WorkerPool(workers, pending, spare=spare)
    violations: list[str] = []
    _checked(pool, violations)
    ran: list[int] = []
    rng = random.Random(seed)

    def work(i: int, ms: int) -> int:
        ran.append(i)
        time.sleep(ms / 1000)
        pool.check_integrity()
        return i

    async def one(i: int, key: int, ms: int) -> int:
        with flow(None if key == 0 else f"flow-{key}", priority=key % 2):  # one priority per flow
            return await pool.run(work, i, ms)

    async def main() -> list:
        tasks = []
        for i, (key, ms, cancel) in enumerate(calls):
            tasks.append((asyncio.create_task(one(i, key, ms)), cancel))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        for task, cancel in tasks:
            if cancel:
                task.cancel()
        return await asyncio.wait_for(asyncio.gather(*(t for t, _ in tasks), return_exceptions=True), LIMIT_S)

    try:
        results = asyncio.run(main())
    finally:
        pool.shutdown()
    for i, got in enumerate(results):
        if not isinstance(got, asyncio.CancelledError):
            assert got == i
    assert sorted(ran) == sorted(set(ran))  # none ran twice
    assert {i for i, got in enumerate(results) if not isinstance(got, BaseException)} <= set(ran)
    assert violations == []
    pool.check_integrity()
    assert pool.admitted == 0 and not pool._ready and not pool._flows


def test_a_queued_flow_is_not_starved_by_requests_calling_one_at_a_time() -> None:
    """Requests whose calls come one after another (ingest, plan, lookup, decode) leave the pool
    between calls and come back as newcomers; the video with its queue still gets a start at least
    once per round of them (it waits since before they came back)."""
    pool = WorkerPool(1, 64)
    starts: list[str] = []
    lock = threading.Lock()

    def work(name: str) -> None:
        with lock:
            starts.append(name)
        time.sleep(0.002)

    async def sequential(k: int) -> None:
        for _ in range(12):
            with flow(f"req-{k}"):
                await pool.run(work, f"req-{k}")

    async def main() -> None:
        with flow("video"):
            video = [asyncio.create_task(pool.run(work, "video")) for _ in range(6)]
        await asyncio.wait_for(asyncio.gather(*video, *(sequential(k) for k in range(3))), LIMIT_S)

    asyncio.run(main())
    pool.shutdown()
    video_at = [i for i, n in enumerate(starts) if n == "video"]
    gaps = [b - a - 1 for a, b in zip(video_at, video_at[1:])]
    assert len(video_at) == 6 and max(gaps) <= 3, starts  # at most one start of each other request between
    assert video_at[-1] < len(starts) - 3  # the video finished while the requests still had calls to make
    pool.check_integrity()


def test_shutdown_without_waiting_cancels_the_queued_calls_and_refuses_new_ones() -> None:
    pool = WorkerPool(1, 16, spare=1)
    gate = threading.Event()

    async def main() -> list:
        with flow("video"):
            held = asyncio.create_task(pool.run(gate.wait, LIMIT_S))
            queued = [asyncio.create_task(pool.run(lambda: "never")) for _ in range(3)]
        await until(lambda: pool.busy >= 1 and pool.admitted >= 4)
        threading.Timer(0.05, gate.set).start()  # the running call ends after the shutdown began
        await asyncio.to_thread(pool.shutdown, False)
        with pytest.raises(RuntimeError, match="shut down"):
            await pool.run(lambda: "late")
        return await asyncio.wait_for(asyncio.gather(held, *queued, return_exceptions=True), LIMIT_S)

    held, *queued = asyncio.run(main())
    assert held is True and all(isinstance(q, asyncio.CancelledError) for q in queued)
    assert pool.admitted == 0 and not pool._ready and not pool._flows


def test_a_more_urgent_flow_goes_first_and_a_less_urgent_newcomer_still_gets_the_spare() -> None:
    """Under the engine's priority policy a request's priority orders its calls too: the batch line
    (priority 10) that came first waits for the interactive request (0); and while an urgent request
    holds every worker, a less urgent one with none running still starts on the spare thread."""
    pool = WorkerPool(1, 16, spare=1)
    call = Calls({"u-held": threading.Event(), "b-held": threading.Event()})

    async def main() -> None:
        with flow("urgent", priority=0):
            urgent = [asyncio.create_task(pool.run(call, "u-held")), asyncio.create_task(pool.run(call, "u2"))]
        await until(lambda: call.order == ["u-held"])
        with flow("batch-line", priority=10):  # none running: the spare thread takes it at once
            assert await asyncio.wait_for(pool.run(call, "b-spare"), LIMIT_S) == "b-spare"
            spare_held = asyncio.create_task(pool.run(call, "b-held"))  # holds the spare thread now
        await until(lambda: call.order[-1] == "b-held")
        with flow("late-batch", priority=10):
            late = asyncio.create_task(pool.run(call, "late"))
        with flow("interactive", priority=0):
            interactive = asyncio.create_task(pool.run(call, "i"))
        await until(lambda: pool.admitted >= 5)
        call.held["u-held"].set()  # one thread frees up: the urgent flows first, the late batch line last
        await asyncio.wait_for(asyncio.gather(*urgent, late, interactive), LIMIT_S)
        call.held["b-held"].set()
        await asyncio.wait_for(spare_held, LIMIT_S)

    try:
        asyncio.run(main())
    finally:
        call.release()
        pool.shutdown()
    # u2's flow was served before i came (round-robin within priority 0); "late" came before i
    assert call.order == ["u-held", "b-spare", "b-held", "u2", "i", "late"]
    pool.check_integrity()


def test_the_spare_thread_takes_a_less_urgent_request_passed_over_for_the_last_worker() -> None:
    """A worker frees up and goes to the urgent request (priority), filling the regular workers while
    a less urgent request with none running waits: that request starts on the spare thread then,
    not once the urgent calls end."""
    pool = WorkerPool(2, 16, spare=1)
    urgent_gate = threading.Event()
    call = Calls({"a0": threading.Event(), "n2": urgent_gate, "n4": urgent_gate})

    async def main() -> str:
        with flow("batch", priority=1):
            a0 = asyncio.create_task(pool.run(call, "a0"))
        await until(lambda: call.order == ["a0"])
        with flow("urgent", priority=0):
            n2 = asyncio.create_task(pool.run(call, "n2"))
        await until(lambda: pool.busy >= 2)
        with flow("batch", priority=1):
            a1 = asyncio.create_task(pool.run(call, "a1"))  # its flow has a0 running: not the spare's
        with flow("urgent", priority=0):
            n4 = asyncio.create_task(pool.run(call, "n4"))
        await until(lambda: pool.admitted >= 4)
        call.held["a0"].set()  # a0's worker goes to n4 (more urgent); a1's flow has none running now
        got = await asyncio.wait_for(a1, LIMIT_S)  # on the spare, while n2 and n4 still hold the workers
        assert not n2.done() and not n4.done()
        urgent_gate.set()
        await asyncio.wait_for(asyncio.gather(a0, n2, n4), LIMIT_S)
        return got

    try:
        assert asyncio.run(main()) == "a1"
    finally:
        call.release()
        pool.shutdown()
    pool.check_integrity()


def test_a_cancelled_call_leaves_the_queue_at_once() -> None:
    """Its arguments (a request's media bytes) are not held until its flow's turn comes round."""
    pool = WorkerPool(1, 16)
    gate = threading.Event()

    async def main() -> None:
        with flow("video"):
            held = asyncio.create_task(pool.run(gate.wait, LIMIT_S))
        await until(lambda: pool.busy >= 1)
        with flow("gone"):
            task = asyncio.create_task(pool.run(len, b"x" * (1 << 20)))
        await until(lambda: "gone" in pool._ready)
        task.cancel()
        await asyncio.sleep(0.01)
        assert "gone" not in pool._ready and "gone" not in pool._flows and pool.admitted == 1
        gate.set()
        assert await asyncio.wait_for(held, LIMIT_S) is True

    try:
        asyncio.run(main())
    finally:
        gate.set()
        pool.shutdown()
    pool.check_integrity()


def test_admission_takes_the_more_urgent_caller_first_and_a_cancelled_one_leaves() -> None:
    """With every slot taken, callers wait for admission: the more urgent priority first, FIFO
    within one; a caller that gives up leaves the waiting line and takes no slot."""
    pool = WorkerPool(1, 0, admit_timeout_s=LIMIT_S)  # one slot
    call = Calls({"held": threading.Event()})

    async def main() -> None:
        with flow("first", 0):
            held = asyncio.create_task(pool.run(call, "held"))
        await until(lambda: call.order == ["held"])
        waiting = []
        for name, priority in (("late", 5), ("urgent", -1), ("gone", -2), ("normal", 0), ("later", 5)):
            with flow(name, priority):
                waiting.append(asyncio.create_task(pool.run(call, name)))
            await until(lambda: pool.waiting == len(waiting), "the caller to wait for admission")
        waiting[2].cancel()  # "gone" gives up while it waits
        await until(lambda: pool.waiting == 4, "the cancelled caller to leave")
        call.release()
        await asyncio.wait_for(asyncio.gather(held, *waiting[:2], *waiting[3:]), LIMIT_S)

    try:
        asyncio.run(main())
    finally:
        call.release()
        pool.shutdown()
    assert call.order == ["held", "urgent", "normal", "late", "later"]
    assert pool.admitted == 0 and pool.waiting == 0
    pool.check_integrity()


def test_a_caller_that_times_out_waiting_for_admission_takes_no_slot() -> None:
    """``admit_timeout_s``: the caller gets ServerBusy (a 503), leaves the waiting line, and the slot
    it never got is not counted; the pool admits the next caller once the held one ends."""
    pool = WorkerPool(1, 0, admit_timeout_s=0.05)
    call = Calls({"held": threading.Event()})

    async def main() -> None:
        held = asyncio.create_task(pool.run(call, "held"))
        await until(lambda: call.order == ["held"])
        with pytest.raises(ServerBusy):
            await pool.run(call, "too late")
        assert pool.waiting == 0 and pool.admitted == 1
        call.release()
        await asyncio.wait_for(held, LIMIT_S)
        assert await asyncio.wait_for(pool.run(call, "next"), LIMIT_S) == "next"

    try:
        asyncio.run(main())
    finally:
        call.release()
        pool.shutdown()
    assert call.order == ["held", "next"] and pool.admitted == 0 and pool.waiting == 0
    pool.check_integrity()
