"""PrioritySlots: a freed slot goes to the most urgent waiter (arrival order among equals); a
waiter cancelled while queued, or just after a slot was handed to it, loses no slot; no schedule of
acquires, cancels and releases leaves a free slot beside a sleeping waiter (hypothesis)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

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


def test_a_slot_freed_while_a_cancelled_waiter_counts_reaches_the_next_waiter():
    """The lost wakeup: B is cancelled while queued, the holder releases before B's task has run
    its cancel, and C's acquire ran in between (so it queued behind B). C must get the slot."""
    async def main() -> None:
        slots = PrioritySlots(1)
        await slots.acquire()
        b = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        c = asyncio.ensure_future(slots.acquire())  # its first step runs after the two lines below
        b.cancel()
        slots.release()  # pops B's cancelled entry: the slot goes to the free ones
        await asyncio.wait_for(c, 2)  # hung forever with _free 1 and C waiting
        await asyncio.gather(b, return_exceptions=True)
        assert slots.waiting == 0
        slots.release()

    asyncio.run(main())


_OPS = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 3)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("turn"), st.just(0))), max_size=40)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3), ops=_OPS)
@example(n=1, ops=[("acquire", 0), ("turn", 0), ("acquire", 0), ("turn", 0), ("acquire", 0),
                   ("cancel", 1), ("release", 0)])  # the lost wakeup above, as a schedule
def test_no_schedule_loses_or_overgives_a_slot(n: int, ops: list[tuple[str, int]]):
    """Any interleaving, ops between loop turns: a release (made at once, as a job's end makes it)
    and a cancel can cross an acquire that has not run yet. Never more than n holders, and once
    the holders let go one by one, every waiter still alive gets a slot and all n come back."""
    async def main() -> None:
        slots = PrioritySlots(n)
        held: list[int] = []  # tasks holding a slot, in the order they got it
        tasks: list[asyncio.Task] = []

        async def user(i: int, priority: int) -> None:
            await slots.acquire(priority)
            held.append(i)
            assert len(held) <= n, "more holders than slots"

        def release_one(k: int) -> None:
            held.pop(k % len(held))
            slots.release()

        for op, arg in ops:
            if op == "acquire":
                tasks.append(asyncio.ensure_future(user(len(tasks), arg)))
            elif op == "cancel" and tasks:
                tasks[arg % len(tasks)].cancel()
            elif op == "release" and held:
                release_one(arg)
            else:
                await asyncio.sleep(0)
        for _ in range(4 * len(tasks) + 4):  # let go one by one: each waiter left must get a slot
            await asyncio.sleep(0)
            if held:
                release_one(0)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2)
        while held:
            release_one(0)
        assert slots.waiting == 0
        for _ in range(n):  # all n slots are free again, each taken at once
            await asyncio.wait_for(slots.acquire(), 1)

    asyncio.run(main())


def test_needs_a_slot():
    with pytest.raises(ValueError, match="n >= 1"):
        PrioritySlots(0)
