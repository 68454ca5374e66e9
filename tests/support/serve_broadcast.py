"""A stand-in for what Serve's ``DeploymentHandle.broadcast(method)`` returns
(``ray.serve.handle.DeploymentBroadcastResponse``), as the ingress's stats refresh reads it: Serve's
result of each replica (``ReplicaResult``: ``get_async``, ``cancel``), reached with
``_fetch_replica_results_async``, and the public ``results_async``, which gathers them all or raises
``TimeoutError`` as Ray 2.60's does. Each replica answers a value, raises an exception, or --
``SILENT`` -- never answers (a hung engine thread, a GC pause, a stuck actor), after ``delay_s``."""

from __future__ import annotations

import asyncio
from typing import Any

SILENT = object()


class ReplicaResult:
    def __init__(self, answer: Any, delay_s: float = 0.0) -> None:
        self.answer, self.delay_s, self.cancelled = answer, delay_s, False

    async def get_async(self) -> Any:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.answer is SILENT:
            await asyncio.Event().wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def cancel(self) -> None:  # Ray's: ray.cancel of the replica's request
        self.cancelled = True


class AllOrNothing:
    """A broadcast response with only the public collection (a Ray without per-replica results)."""

    def __init__(self, answers: list[Any]) -> None:
        self.replica_results = [a if isinstance(a, ReplicaResult) else ReplicaResult(a) for a in answers]

    async def results_async(self, *, timeout_s: float | None = None, return_exceptions: bool = False) -> list[Any]:
        gather = asyncio.gather(*[r.get_async() for r in self.replica_results], return_exceptions=return_exceptions)
        try:
            return list(await asyncio.wait_for(gather, timeout_s))
        except asyncio.TimeoutError:
            raise TimeoutError("Timed out waiting for broadcast results.") from None


class Broadcast(AllOrNothing):
    """Ray 2.60's: the replicas' results one by one too."""

    async def _fetch_replica_results_async(self) -> list[ReplicaResult]:
        return self.replica_results
