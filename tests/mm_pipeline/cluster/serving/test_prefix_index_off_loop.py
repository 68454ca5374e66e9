"""The prefix index keeps Redis off the router's event loop (router_state.py's module doc): a lookup
is awaited on a reader thread and bounded, writes go to one writer thread in order, a full writer
queue drops (counted) instead of blocking, and the memory index answers inline."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import pytest

from mm_pipeline.cluster.serving.route_key import key_of_pieces
from mm_pipeline.cluster.serving.router_state import MemoryPrefixIndex, RedisPrefixIndex
from mm_pipeline.cluster.serving.write_behind import WriteBehind

TIMEOUT_S = 0.25  # the router's Redis socket timeout (index_for's default)
LOOKUP_S = 0.1  # the most a lookup waits in the silent-Redis test
MAX_LAG_S = 0.1  # "well below" it: a blocking call on the loop shows up as >= TIMEOUT_S


def chain(seq) -> tuple[int, ...]:
    return key_of_pieces([("tokens", [t] * 16) for t in seq]).hashes


def test_a_silent_redis_never_stalls_the_loop(silent_redis_url, max_loop_lag):
    """Every call waits out the socket timeout (retry_after_s=0: no pause after an error), yet the
    loop keeps ticking; each lookup is a miss after at most ~lookup_timeout_s. (The lookup bound is
    under the socket timeout here: at equal values the socket error and the bound race, and on a
    loaded machine the error may win every time, leaving no timeout to count.)"""
    index = RedisPrefixIndex(silent_redis_url, timeout_s=TIMEOUT_S, retry_after_s=0.0,
                             lookup_timeout_s=LOOKUP_S)
    waits: list[float] = []

    async def work() -> None:
        for i in range(4):
            start = time.monotonic()
            assert await index.lookup(chain([i, 1]), ["a", "b"]) == {"a": 0, "b": 0}
            waits.append(time.monotonic() - start)
            index.record("a", chain([i, 1]))  # what on_request_routed does
            index.forget("b")  # what a replica's death does

    try:
        lag = asyncio.run(max_loop_lag(work))
        assert lag < MAX_LAG_S, f"the loop stalled {lag * 1000:.0f} ms"
        assert max(waits) < LOOKUP_S + 0.2 and index.lookup_timeouts >= 1
    finally:
        start = time.monotonic()
        index.close(drain_s=0.1)
        assert time.monotonic() - start < 3.0
    assert not index._writer._thread.is_alive()


def test_writes_run_in_submission_order():
    """One writer thread: whatever each write takes, a later one never overtakes it."""
    ran: list[int] = []
    writer = WriteBehind("test-order")
    try:
        for i in range(200):
            writer.submit(lambda i=i: (time.sleep(0.0005 * (i % 3)), ran.append(i)))
        assert writer.flush(10.0)
        assert ran == list(range(200))
    finally:
        writer.close()


def gate(writer: WriteBehind) -> threading.Event:
    """Hold the writer thread in a write until the returned event is set (so writes queue up)."""
    started, release = threading.Event(), threading.Event()
    writer.submit(lambda: (started.set(), release.wait(10.0)))
    assert started.wait(5.0)
    return release


def test_a_full_queue_drops_the_oldest_without_blocking(caplog):
    ran: list[int] = []
    writer = WriteBehind("test-full", max_pending=3, log_every_s=60.0)
    try:
        release = gate(writer)
        with caplog.at_level(logging.WARNING, logger="mm_pipeline.cluster.serving.write_behind"):
            start = time.monotonic()
            for i in range(10):
                writer.submit(lambda i=i: ran.append(i))
            assert time.monotonic() - start < 0.05  # the writer is stuck; the caller is not
        assert writer.dropped == 7 and writer.pending() == 4  # 3 queued + the one in flight
        assert len([r for r in caplog.records if "queue full" in r.getMessage()]) == 1  # rate-limited
        release.set()
        assert writer.flush(5.0)
        assert ran == [7, 8, 9]  # the newest kept
    finally:
        writer.close()


def test_close_drains_then_stops_and_drops_later_writes():
    ran: list[int] = []
    writer = WriteBehind("test-close")
    release = gate(writer)
    for i in range(3):
        writer.submit(lambda i=i: ran.append(i))
    release.set()
    writer.close(drain_s=5.0)
    assert ran == [0, 1, 2] and not writer._thread.is_alive()
    writer.submit(lambda: ran.append(99))  # after close: dropped, not an error
    assert ran == [0, 1, 2]


def test_a_failing_write_does_not_stop_the_writer():
    ran: list[int] = []
    writer = WriteBehind("test-fail")
    try:
        writer.submit(lambda: 1 / 0)
        writer.submit(lambda: ran.append(1))
        assert writer.flush(5.0) and ran == [1] and writer.failed == 1
    finally:
        writer.close()


def test_redis_writes_drop_when_redis_is_slow(silent_redis_url):
    """Routing far faster than a stuck Redis takes writes: bounded queue, counted drops, no wait."""
    index = RedisPrefixIndex(silent_redis_url, timeout_s=TIMEOUT_S, retry_after_s=0.0, max_pending_writes=8)
    try:
        start = time.monotonic()
        for i in range(200):
            index.record("a", chain([i]))
        assert time.monotonic() - start < 0.1
        assert index.dropped_writes >= 200 - 8 - 1 - 2  # a write or two may have been taken meanwhile
        assert index._writer.pending() <= 9
    finally:
        index.close(drain_s=0.1)


@pytest.fixture(scope="module")
def redis_url(redis_server) -> str:
    return f"redis://127.0.0.1:{redis_server}/0"


def test_records_then_forget_keep_their_order_in_redis(redis_url):
    """record(a, x); forget(a); record(a, y), all queued while the writer is busy: x is gone, y is
    there -- the forget ran after the first record and before the second."""
    index = RedisPrefixIndex(redis_url, prefix=f"t:{uuid.uuid4().hex}:")
    try:
        x, y = chain([1, 2, 3]), chain([7, 8])
        release = gate(index._writer)
        for _ in range(20):
            index.record("a", x)
        index.record("b", x)
        index.forget("a")
        index.record("a", y)
        release.set()
        assert index.flush(5.0)
        assert index.match(x, ["a", "b"]) == {"a": 0, "b": 3}
        assert asyncio.run(index.lookup(y, ["a", "b"])) == {"a": 2, "b": 0}
    finally:
        index.close()


def test_memory_lookup_answers_inline():
    """No Redis, no thread hop: the coroutine finishes on its first step without suspending."""
    index = MemoryPrefixIndex()
    index.record("a", chain([1, 2]))
    step = index.lookup(chain([1, 3]), ["a", "b"])
    with pytest.raises(StopIteration) as done:
        step.send(None)
    assert done.value.value == {"a": 1, "b": 0}
    assert index.flush() is True
