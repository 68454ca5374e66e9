"""PrioritySlots: a freed slot goes to the most urgent waiter (arrival order among equals); a
waiter cancelled while queued, or just after a slot was handed to it, loses no slot."""

from __future__ import annotations

import asyncio

import pytest

from mm_pipeline.priority_slots import PrioritySlots


def test_freed_slots_go_by_priority_then_arrival():
    async def main() -> list[str]:
        slots = PrioritySlots(1)
        order: list[str] = []
        gate = asyncio.Event()

        async def job(name: str, priority: int) -> None:
            async with slots.slot(priority):
                order.append(name)
                await gate.wait()

        first = asyncio.ensure_future(job("first", 9))
        await asyncio.sleep(0)
        waiters = [asyncio.ensure_future(job(n, p)) for n, p in [("a", 5), ("b", 0), ("c", 5), ("d", 0)]]
        await asyncio.sleep(0)
        assert slots.waiting == 4
        gate.set()
        await asyncio.gather(first, *waiters)
        assert slots.waiting == 0
        return order

    assert asyncio.run(main()) == ["first", "b", "d", "a", "c"]


def test_cancelled_waiters_lose_no_slot():
    async def main() -> None:
        slots = PrioritySlots(1)
        await slots.acquire()
        queued = asyncio.ensure_future(slots.acquire(0))
        handed = asyncio.ensure_future(slots.acquire(1))
        await asyncio.sleep(0)
        queued.cancel()  # cancelled while queued: its entry is skipped
        await asyncio.gather(queued, return_exceptions=True)
        assert slots.waiting == 1
        slots.release()  # to `handed`, which is cancelled before it resumes: it passes the slot on
        handed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handed
        assert slots.waiting == 0
        await asyncio.wait_for(slots.acquire(), 1)  # the slot came back, and only the one
        extra = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        assert slots.waiting == 1 and not extra.done()
        extra.cancel()
        await asyncio.gather(extra, return_exceptions=True)

    asyncio.run(main())


def test_needs_a_slot():
    with pytest.raises(ValueError, match="n >= 1"):
        PrioritySlots(0)
