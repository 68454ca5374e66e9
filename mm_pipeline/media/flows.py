"""Flows: the request a piece of work is for, and whose turn it is (to be served, to be admitted).

A *flow* is one request's share of a shared resource: its calls in the media worker pool (its
ingest, planning, its video's chunk decodes; media/worker_pool.py) and its units in the encoder
queue (encode/batcher.py). ``flow(key, priority)`` marks the calls made in a block, and those of the
tasks started in it, as the request's; ``current_flow`` reads the mark.

``Turns`` is the round-robin both queues serve flows in. Each flow known has a rank: (tick, 1)
after it was last served, (tick, 0) after it arrived unserved, the tick counting services. The
lowest rank goes next: the flow served longest ago. A newcomer joins the round just before the
flow served last when it came, after every other: so it goes at once past a flow that holds the
queue alone (a video's chunk decodes, its frame groups), and a flow waits for at most one service
of each other flow -- newcomers arriving without end cannot starve one that came before them.

``Admission`` is the line before a queue of bounded size (the media worker pool's): at most
``capacity`` callers hold a slot; the others wait, the more urgent priority first (the flow's),
FIFO within one. A slot is given back from any thread and handed to the next waiter on that
waiter's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import itertools
import threading
from collections.abc import Hashable, Iterator

# the flow (request) on whose behalf the current task works, and its priority; None: the shared
# flow (priority 0)
_flow: contextvars.ContextVar[tuple[Hashable | None, int]] = contextvars.ContextVar("media_flow",
                                                                                    default=(None, 0))


@contextlib.contextmanager
def flow(key: Hashable, priority: int = 0) -> Iterator[None]:
    """Work started in this block -- and by tasks created in it, which copy the context -- belongs
    to flow ``key`` (a request id): the media pool and the encoder queue take turns between flows,
    a lower ``priority`` first (the request's, under the engine's ``priority`` queue policy). Enter
    and leave it without an await-spanning ``yield`` in between (an async generator's context may
    change there)."""
    token = _flow.set((key, priority))
    try:
        yield
    finally:
        _flow.reset(token)


def current_flow() -> tuple[Hashable | None, int]:
    """(key, priority) of the flow the calling task works for; (None, 0) outside any."""
    return _flow.get()


class Turns:
    """Round-robin ranks of flows (module doc). Not thread-safe: its owner's lock guards it."""

    def __init__(self) -> None:
        self.tick = 0
        self._rank: dict[Hashable, tuple[int, int]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    def arrive(self, key: Hashable) -> None:
        """``key`` has work waiting: a flow not known yet joins the round (module doc)."""
        if key not in self._rank:
            self._rank[key] = (self.tick, 0)

    def rank(self, key: Hashable) -> tuple[int, int]:
        return self._rank[key]

    def served(self, key: Hashable) -> bool:
        """Has ``key`` been served since it was last forgotten?"""
        return self._rank[key][1] == 1

    def serve(self, *keys: Hashable) -> None:
        """One service (a call started, a batch taken) for ``keys``: they go to the end of the round."""
        self.tick += 1
        for key in keys:
            self._rank[key] = (self.tick, 1)

    def forget(self, key: Hashable) -> None:
        """``key`` comes back as a newcomer, if ever."""
        self._rank.pop(key, None)

    def trim(self, limit: int, keep: set[Hashable]) -> None:
        """Bound the memory of a queue that remembers flows between their visits: past ``limit``
        known flows, forget those served longest ago, except ``keep`` (flows with work waiting),
        down to half of ``limit``."""
        if len(self._rank) <= limit:
            return
        idle = sorted((k for k in self._rank if k not in keep), key=self._rank.__getitem__)
        for key in idle[:max(0, len(self._rank) - limit // 2)]:
            del self._rank[key]


class Admission:
    """A bounded number of slots, waited for in priority order (module doc); usable from any event
    loop and any thread.

    Invariants (under ``_lock``): ``0 <= _admitted <= capacity``; a waiter is only woken by handing
    it a slot that stays counted in ``_admitted``."""

    def __init__(self, capacity: int, timeout_s: float | None = None) -> None:
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._admitted = 0
        # callers waiting for admission: a heap of (priority, arrival, loop, future), the more
        # urgent first, FIFO within a priority
        self._waiters: list[tuple[int, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        # arrivals of the entries still waiting: one whose caller gave up stays in the heap until
        # popped (skipped then) or compacted -- no O(n) removal under the lock per departure
        self._queued: set[int] = set()
        # arrivals popped by ``release`` whose ``_grant`` has not run on their loop yet
        self._handing: set[int] = set()

    @property
    def admitted(self) -> int:
        """Slots held."""
        with self._lock:
            return self._admitted

    @property
    def waiting(self) -> int:
        """Callers suspended for a slot."""
        with self._lock:
            return len(self._queued)

    async def acquire(self, priority: int = 0) -> None:
        """Wait for a slot; when none is free, the more urgent ``priority`` is admitted first (the
        engine's ``priority`` queue policy), FIFO within one. Past ``timeout_s``: asyncio.TimeoutError."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._admitted < self.capacity and not self._queued:
                self._admitted += 1
                return
            fut: asyncio.Future[None] = loop.create_future()
            arrival = next(self._arrivals)
            heapq.heappush(self._waiters, (priority, arrival, loop, fut))
            self._queued.add(arrival)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            with self._lock:
                queued = arrival in self._queued  # else a slot was handed to us (or is on its way)
                if queued:
                    self._queued.discard(arrival)  # its entry is skipped when popped
                    if len(self._waiters) > 2 * len(self._queued) + 64:  # mostly departed: compact
                        self._waiters = [e for e in self._waiters if e[1] in self._queued]
                        heapq.heapify(self._waiters)
                else:  # a slot was handed to us: on its way (its _grant then does nothing) or here
                    self._handing.discard(arrival)
            if not queued:
                self.release()  # from here: not left to a _grant that a closing loop may drop
            raise

    def release(self) -> None:
        """Give a slot back: to the next waiter if any, else free."""
        with self._lock:
            while self._queued:
                _, arrival, loop, fut = heapq.heappop(self._waiters)
                if arrival in self._queued:  # the slot passes to this waiter
                    self._queued.discard(arrival)
                    self._handing.add(arrival)
                    break
            else:
                self._waiters.clear()  # only departed entries left
                self._admitted -= 1
                return
        try:
            loop.call_soon_threadsafe(self._grant, fut, arrival)
        except RuntimeError:  # the waiter's loop is closed: nobody will take the slot
            with self._lock:  # (unless the waiter gave up meanwhile: it passed the slot on itself)
                mine = arrival in self._handing
                self._handing.discard(arrival)
            if mine:
                self.release()

    def check_integrity(self) -> None:
        with self._lock:
            if not 0 <= self._admitted <= self.capacity:
                raise AssertionError(f"admitted {self._admitted} outside [0, {self.capacity}]")
            if not self._queued <= {e[1] for e in self._waiters} or self._queued & self._handing:
                raise AssertionError("a waiter counted as queued is not in the waiting line, or also handed a slot")

    def _grant(self, fut: asyncio.Future[None], arrival: int) -> None:
        """On the waiter's loop: hand it the slot, unless it gave up (and passed the slot on)."""
        with self._lock:
            if arrival not in self._handing:
                return
            self._handing.discard(arrival)
        fut.set_result(None)  # not done: giving up discards ``arrival`` first, on this loop
