"""Ordinary inputs side by side, or one suspect input with nothing else running in the process.

A replica answers the inputs of several batches at once on one event loop.  When its process
dies, every input in flight becomes a suspect, and the death names none of them: a death names an input
only when that input was running alone in the process, from every batch.  ``AloneGate`` gives
that: any number of ``ordinary()`` holders at once, or one ``alone()`` holder and nothing else.

    ordinary a   ═══════════╡
    ordinary b   ══════╡
    suspect s1       ·······════════╡                 waits until a and b are done
    suspect s2          ············════════╡         one suspect at a time
    ordinary c             ·················═══════   came while suspects waited: waits for them

A waiting suspect holds new ordinary inputs back (else a busy replica's stream of fresh batches
would keep it waiting for good); suspects run one at a time, in the order they came.  Single
event loop, no lock: every check and change of the counts happens between two awaits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable


class AloneGate:
    def __init__(self) -> None:
        self._ordinary = 0  # ordinary inputs running
        self._suspects = 0  # suspects waiting or running
        self._alone = False  # a suspect is running
        self._waiters: list[asyncio.Future] = []
        # suspects waiting, in arrival order: only the first may start (a wake-up wakes every
        # waiter, and one arriving between a wake-up and the woken suspect's turn would go first)
        self._queue: deque[object] = deque()

    @asynccontextmanager
    async def ordinary(self) -> AsyncIterator[None]:
        await self._until(lambda: not self._suspects)
        self._ordinary += 1
        try:
            yield
        finally:
            self._ordinary -= 1
            self._wake()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        self._suspects += 1
        turn = object()
        self._queue.append(turn)
        try:
            try:
                await self._until(lambda: self._queue[0] is turn and not self._alone and not self._ordinary)
            finally:  # started, or cancelled while waiting: either way no longer in the line
                self._queue.remove(turn)
            self._alone = True
            try:
                yield
            finally:
                self._alone = False
        finally:
            self._suspects -= 1
            self._wake()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def _wake(self) -> None:
        """Every waiter checks its condition again (first come, first checked)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
