"""Flows: the request a piece of work is for, and whose turn it is.

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
"""

from __future__ import annotations

import contextlib
import contextvars
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
