"""SingleFlight, the one single-flight of the pipeline (encoder units, media planning): one
computation per key across threads and event loops, errors reach every joiner, a cancelled joiner
leaves alone, a cancelled computing caller fails its joiners, and no key is ever left behind --
checked on fixed scenarios and on random operation sequences against a model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.encode.single_flight import SingleFlight


class Abandoned(Exception):
    pass


# ---- callback form, threads -------------------------------------------------------------------

def _threads_join(sf: SingleFlight[int], n: int, outcome: int | BaseException) -> tuple[int, list[object]]:
    """``n`` threads ask for "k" at once; the one that claims it computes for 0.1 s."""
    gate = threading.Barrier(n)
    computes = 0
    results: list[object] = []
    lock = threading.Lock()

    def worker() -> None:
        nonlocal computes
        got = threading.Event()

        def waiter(value, error) -> None:
            with lock:
                results.append(error if error is not None else value)
            got.set()

        gate.wait()
        if sf.join("k", waiter):
            with lock:
                computes += 1
            time.sleep(0.1)  # long enough for every thread to join the flight
            if isinstance(outcome, BaseException):
                sf.finish("k", error=outcome)
            else:
                sf.finish("k", outcome)
        assert got.wait(5)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return computes, results


def test_thread_single_flight_computes_once() -> None:
    sf: SingleFlight[int] = SingleFlight()
    computes, results = _threads_join(sf, 8, 5)
    assert computes == 1 and results == [5] * 8
    sf.check_integrity()
    assert sf.join("k", lambda v, e: None) is True  # the key is free again once finished


def test_thread_single_flight_error_reaches_all_and_poisons_nothing() -> None:
    sf: SingleFlight[int] = SingleFlight()
    error = RuntimeError("encoder exploded")
    computes, results = _threads_join(sf, 6, error)
    assert computes == 1 and len(results) == 6 and all(r is error for r in results)
    sf.check_integrity()
    computes, results = _threads_join(sf, 3, 6)  # retried, not poisoned
    assert computes == 1 and results == [6] * 3


# ---- asyncio form -------------------------------------------------------------------------------

def test_async_single_flight() -> None:
    sf: SingleFlight[int] = SingleFlight(lambda: Abandoned("the computing request went away"))
    calls = 0

    async def compute() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return 9

    async def failing() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        raise RuntimeError("boom")

    async def scenario() -> None:
        nonlocal calls
        outs = await asyncio.gather(*(sf.run("a", compute) for _ in range(20)))
        assert calls == 1 and sorted(outs) == [(9, False)] * 19 + [(9, True)]

        calls = 0
        outs = await asyncio.gather(*(sf.run("b", failing) for _ in range(10)), return_exceptions=True)
        assert calls == 1 and all(isinstance(o, RuntimeError) for o in outs)
        assert await sf.run("b", compute) == (9, True)  # not poisoned

        calls = 0  # a cancelled joiner does not cancel the computation for the others
        first = asyncio.create_task(sf.run("c", compute))
        second = asyncio.create_task(sf.run("c", compute))
        await asyncio.sleep(0.01)
        second.cancel()
        assert await first == (9, True) and calls == 1
        with pytest.raises(asyncio.CancelledError):
            await second

        calls = 0  # the computing caller cancelled (its client left): the others still get the value
        first = asyncio.create_task(sf.run("d", compute))
        second = asyncio.create_task(sf.run("d", compute))
        await asyncio.sleep(0.01)
        first.cancel()
        assert await second == (9, False) and calls == 1
        with pytest.raises(asyncio.CancelledError):
            await first

        calls, abandoned = 0, []  # every caller gone: the computation is cancelled, abandon() called
        first = asyncio.create_task(sf.run("e", compute, abandon=lambda: abandoned.append(1)))
        second = asyncio.create_task(sf.run("e", compute))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        assert not abandoned  # one still waits
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await asyncio.sleep(0)  # the computation's own cancellation runs
        assert abandoned == [1] and "e" not in sf
        assert calls == 1 and await sf.run("e", compute) == (9, True)  # not poisoned

    asyncio.run(scenario())
    sf.check_integrity()


def test_a_caller_arriving_as_the_computation_is_abandoned_computes_afresh() -> None:
    """The last caller leaves: the computation is cancelled, but its cancellation runs later on the
    loop. A caller arriving in between starts a computation of its own -- joining the dying one
    would hand it the abandoned() error for a request that never went away."""
    sf: SingleFlight[int] = SingleFlight(lambda: Abandoned("gone"))
    calls, abandoned = 0, []

    async def scenario() -> tuple[int, bool]:
        gate = asyncio.Event()

        async def compute() -> int:
            nonlocal calls
            calls += 1
            mine = calls
            await gate.wait()
            return mine

        first = asyncio.create_task(sf.run("k", compute, abandon=lambda: abandoned.append(1)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first computation is running
        first.cancel()  # its handler leaves and cancels the computation (the cancel itself is queued)
        second = asyncio.create_task(sf.run("k", compute))  # runs before the queued cancel
        await asyncio.sleep(0)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        out = await second
        await asyncio.sleep(0)  # the first computation's own end
        return out

    assert asyncio.run(scenario()) == (2, True)
    assert calls == 2 and abandoned == [1]
    sf.check_integrity()


def test_joiners_on_another_event_loop() -> None:
    sf: SingleFlight[int] = SingleFlight()
    started, release = threading.Event(), threading.Event()

    async def compute() -> int:
        started.set()
        await asyncio.to_thread(release.wait, 5)
        return 7

    leader: list[tuple[int, bool]] = []
    thread = threading.Thread(target=lambda: leader.append(asyncio.run(sf.run("k", compute))))
    thread.start()
    assert started.wait(5)

    async def join() -> tuple[int, bool]:
        task = asyncio.ensure_future(sf.run("k", compute))
        await asyncio.sleep(0.01)
        assert sf.wanted("k")  # joined the other loop's computation
        release.set()
        return await task

    assert asyncio.run(join()) == (7, False)
    thread.join(5)
    assert leader == [(7, True)]
    sf.check_integrity()


# ---- random sequences against a model -------------------------------------------------------------

KEYS = ("a", "b", "c")
ops_strategy = st.lists(st.one_of(
    st.tuples(st.just("join"), st.sampled_from(KEYS)),
    st.tuples(st.just("leave"), st.sampled_from(KEYS), st.integers(0, 4)),
    st.tuples(st.just("finish"), st.sampled_from(KEYS), st.booleans()),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops_strategy)
def test_callback_form_matches_a_model(ops) -> None:
    sf: SingleFlight[int] = SingleFlight()
    flights: dict[str, list[int]] = {}  # model: key -> ids of the waiters still joined
    calls: dict[int, list[object]] = {}
    left: set[int] = set()
    waiters = []

    def make_waiter(wid: int):
        def waiter(value, error) -> None:
            calls.setdefault(wid, []).append(error if error is not None else value)
        return waiter

    for step, op in enumerate(ops):
        if op[0] == "join":
            wid = len(waiters)
            waiters.append(make_waiter(wid))
            claimed = sf.join(op[1], waiters[wid])
            assert claimed == (op[1] not in flights)
            flights.setdefault(op[1], []).append(wid)
        elif op[0] == "leave":
            joined = flights.get(op[1], [])
            if joined:
                wid = joined.pop(op[2] % len(joined))
                sf.leave(op[1], waiters[wid])
                left.add(wid)
        else:
            outcome = step if op[2] else ValueError(f"failed at {step}")
            if isinstance(outcome, int):
                sf.finish(op[1], outcome)
            else:
                sf.finish(op[1], error=outcome)
            for wid in flights.pop(op[1], []):
                assert calls[wid] == [outcome]  # exactly once, with this computation's outcome
        assert len(sf) == len(flights) and all((k in sf) == (k in flights) for k in KEYS)
        assert all(sf.wanted(k) == bool(flights.get(k)) for k in KEYS)
    for key in list(flights):
        sf.finish(key, -1)
    sf.check_integrity()
    assert all(len(calls.get(w, [])) == (0 if w in left else 1) for w in range(len(waiters)))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), fail=st.booleans(), cancel=st.sets(st.integers(0, 5)))
def test_async_form_outcomes(n, fail, cancel) -> None:
    """``n`` callers of one key (caller 0 starts the computation); some are cancelled mid-flight.
    The others get the computation's outcome whoever left; it is abandoned only when all left."""
    sf: SingleFlight[int] = SingleFlight(lambda: Abandoned("gone"))
    calls, abandoned = 0, []

    async def scenario() -> list[object]:
        gate = asyncio.Event()

        async def compute() -> int:
            nonlocal calls
            calls += 1
            await gate.wait()
            if fail:
                raise RuntimeError("boom")
            return 3

        tasks = [asyncio.create_task(sf.run("k", compute, abandon=lambda: abandoned.append(1))) for _ in range(n)]
        await asyncio.sleep(0)  # every caller has joined (or claimed)
        await asyncio.sleep(0)  # the computation started
        for i in cancel & set(range(n)):
            tasks[i].cancel()
        gate.set()
        outs = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # a cancelled computation's own end
        return outs

    outs = asyncio.run(scenario())
    assert calls == 1
    sf.check_integrity()
    assert abandoned == ([1] if set(range(n)) <= cancel else [])
    for i, out in enumerate(outs):
        if i in cancel:
            assert isinstance(out, asyncio.CancelledError)
        elif fail:
            assert isinstance(out, RuntimeError) and str(out) == "boom"
        else:
            assert out == (3, i == 0)
