"""``AloneGate``: ordinary inputs side by side, a suspect with nothing else running, and a waiting
suspect holds fresh ordinary inputs back (a replica that keeps getting batches cannot starve it)."""

from __future__ import annotations

import asyncio

from mm_pipeline.cluster.alone_gate import AloneGate


async def _hold(gate: AloneGate, name: str, alone: bool, steps: int, log: list[str]) -> None:
    async with gate.alone() if alone else gate.ordinary():
        log.append(f"+{name}")
        for _ in range(steps):
            await asyncio.sleep(0)
        log.append(f"-{name}")


def test_a_suspect_runs_with_nothing_beside_it_and_before_later_ordinary_inputs():
    async def scene() -> list[str]:
        gate, log = AloneGate(), []
        tasks = [asyncio.create_task(_hold(gate, "a", False, 4, log)),
                 asyncio.create_task(_hold(gate, "b", False, 2, log))]
        await asyncio.sleep(0)  # a and b run
        tasks += [asyncio.create_task(_hold(gate, "s1", True, 2, log)),
                  asyncio.create_task(_hold(gate, "s2", True, 2, log))]
        await asyncio.sleep(0)  # the suspects wait
        tasks.append(asyncio.create_task(_hold(gate, "c", False, 1, log)))  # a fresh batch's input
        await asyncio.gather(*tasks)
        return log

    log = asyncio.run(scene())
    assert log == ["+a", "+b", "-b", "-a", "+s1", "-s1", "+s2", "-s2", "+c", "-c"]


def test_a_cancelled_suspect_lets_the_others_go():
    """A batch cancelled while its suspect waits (its task ends) must not hold the replica's other
    inputs back for good."""
    async def scene() -> list[str]:
        gate, log = AloneGate(), []
        a = asyncio.create_task(_hold(gate, "a", False, 10, log))
        await asyncio.sleep(0)
        s = asyncio.create_task(_hold(gate, "s", True, 1, log))
        await asyncio.sleep(0)
        c = asyncio.create_task(_hold(gate, "c", False, 1, log))
        await asyncio.sleep(0)
        s.cancel()
        await asyncio.wait_for(asyncio.gather(a, c), timeout=5)
        assert s.cancelled()
        return log

    assert asyncio.run(scene()) == ["+a", "+c", "-c", "-a"]


def test_suspects_run_in_the_order_they_came():
    """s3 arrives in the loop turn s1 ends, before the woken s2 has run: it still goes after s2
    (a wake-up wakes every waiter; the line decides). A cancelled suspect at the head of the line
    lets the next one go."""
    async def scene() -> list[str]:
        gate, log = AloneGate(), []
        s1_done = asyncio.Event()

        async def held(name: str) -> None:
            async with gate.alone():
                log.append(name)
                if name == "s1":
                    await s1_done.wait()

        t1 = asyncio.create_task(held("s1"))
        await asyncio.sleep(0)
        t2 = asyncio.create_task(held("s2"))
        await asyncio.sleep(0)
        s1_done.set()
        t3 = asyncio.create_task(held("s3"))
        await asyncio.wait_for(asyncio.gather(t1, t2, t3), 5)
        # the head of the line cancelled while it waits
        blocker = asyncio.create_task(_hold(gate, "x", False, 10, log))
        await asyncio.sleep(0)
        head, after = asyncio.create_task(held("cancelled")), None
        await asyncio.sleep(0)
        after = asyncio.create_task(held("s4"))
        await asyncio.sleep(0)
        head.cancel()
        await asyncio.wait_for(asyncio.gather(blocker, after), 5)
        return log

    assert asyncio.run(scene()) == ["s1", "s2", "s3", "+x", "-x", "s4"]
