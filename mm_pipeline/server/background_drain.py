"""BackgroundDrain: what a server's shutdown does to the work it runs with no HTTP request open --
background responses (responses_api/background.py) and batches (batches/runner.py), its *owners*.
uvicorn's drain waits for connections only: without this the owners would be ended the moment the
last connection closed, however long the grace period, and would take new work meanwhile.

    SIGTERM / SIGINT        begin(grace_s) (launch/runner.py DrainingServer): each owner takes no new
                            work from now on -- a new background response or batch is a 503, as the
                            engine's refusal is -- and what it runs goes on
    the grace period        the HTTP requests in flight finish (uvicorn; DrainingServer aborts the
                            ones still running when it ends)
    the app stops           finish() (the lifespan's end): waits while an owner is busy, until
                            ``grace_s`` after begin, then closes each: what still runs ends, recorded
                            in a terminal state that says the server shut down (a background response
                            failed, a batch cancelled with its answered lines' files kept); each
                            owner's close is bounded (a few seconds), so the process exits
    a second Ctrl-C         hurry(): finish stops waiting (uvicorn stops waiting for connections)

A server stopped without a drain (``ServerThread`` in tests and notebooks, a Ray replica) closes its
owners at once. Event loop only, but ``hurry``, which a signal handler may call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, Sequence

POLL_S = 0.05  # how often finish looks whether the owners are still busy (uvicorn polls connections at 0.1 s)


class BackgroundOwner(Protocol):
    def stop_taking(self) -> None:
        """Refuse new work from now on (a 503); the work taken goes on."""

    @property
    def busy(self) -> bool:
        """Some of its work is still running."""

    async def close(self) -> None:
        """End what still runs, each recorded in a terminal state naming the shutdown; bounded."""


class BackgroundDrain:
    def __init__(self, owners: Sequence[BackgroundOwner]) -> None:
        self.owners = list(owners)
        self._deadline: float | None = None  # time.monotonic() at which finish stops waiting; None: no drain

    def begin(self, grace_s: float) -> None:
        """A drain starts now: the owners take no new work, and may run theirs for ``grace_s``."""
        self._deadline = time.monotonic() + grace_s
        for owner in self.owners:
            owner.stop_taking()

    def hurry(self) -> None:
        """Stop waiting for the owners (a second Ctrl-C). A float store only: safe in a signal handler."""
        self._deadline = time.monotonic()

    async def finish(self) -> None:
        """Let the owners' work run until the drain's grace period ends (not at all without a drain),
        then close them. Called once, as the app stops."""
        for owner in self.owners:
            owner.stop_taking()
        while (self._deadline is not None and time.monotonic() < self._deadline
               and any(owner.busy for owner in self.owners)):
            await asyncio.sleep(POLL_S)
        await asyncio.gather(*(owner.close() for owner in self.owners))
