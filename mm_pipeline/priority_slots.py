"""A fixed number of slots handed out the more urgent first: the offline API's admission gate.

``MultimodalLLM`` keeps at most ``max_queue`` of its requests in the engine; the others wait here.
A freed slot goes to the waiter with the lowest ``(priority, arrival)``: lower priority value
first (vLLM's rule, the engine's ``priority`` queue policy), arrival order among equals. With every
priority 0 (no priorities given, or the ``fcfs`` policy, which refuses any other value) that is
plain FIFO, as an ``asyncio.Semaphore`` serves its waiters.

    slots full (max_queue 1)     waiting: A1(p=5) A2(p=5) B1(p=0, came last)
    a slot is freed          ->  B1 gets it, then A1, then A2

One event loop only (not thread-safe): every call runs on the loop that awaits the slots.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager
from typing import AsyncIterator


class PrioritySlots:
    """``n`` slots; ``async with slots.slot(priority):`` holds one for the block."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"PrioritySlots needs n >= 1, got {n}")
        self._free = n
        # (priority, arrival, future): a cancelled waiter's entry stays until popped (skipped then)
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._waiting = 0  # entries whose future is not done: waiters still owed a slot

    # ---- public API -------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Callers waiting for a slot now."""
        return self._waiting

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot, waiting behind every more urgent waiter and every equal one that came first
        (a free slot is taken at once only when nobody waits)."""
        if self._free > 0 and self._waiting == 0:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._arrivals), fut))
        self._waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.cancelled():  # still queued: its entry is skipped when popped
                self._waiting -= 1
                # A slot released between the cancel and this line skipped the dead entry and went
                # to the free ones while this waiter still counted, so a newer caller queued behind
                # it (the fast path saw a waiter): hand the free slots to the live waiters now.
                self._hand_free_slots()
            else:  # a slot was handed over just before the cancel: pass it on
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back: to the most urgent waiter, else to the free ones."""
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                self._waiting -= 1
                fut.set_result(None)
                return
        self._free += 1

    # ---- internal helpers -------------------------------------------------------------------
    def _hand_free_slots(self) -> None:
        while self._free > 0 and self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():  # a done entry is a cancelled waiter, which counts itself out
                self._free -= 1
                self._waiting -= 1
                fut.set_result(None)
