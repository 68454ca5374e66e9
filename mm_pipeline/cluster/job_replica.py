"""A Ray Data actor that holds one engine and answers batches of job inputs, exactly once.

Ray Data creates ``concurrency=N`` of these (``map_batches(ReplicaClass, ...)``) and feeds each
several batches at a time (``__call__`` is a coroutine, so batches overlap on the actor's event
loop and the engine's cross-request batching stays full while a batch's stragglers finish).

Exactly once, per batch:

    refresh the ShardIndex (rows every replica journaled so far)
    inputs already journaled -> their outcome from the index (a retried batch after a death)
    the others, concurrently (a suspect alone) -> engine -> row -> ShardJournal.append (flushed)
        as each finishes
    -> one small result row per input (key, error, tokens) plus this batch's report

When the process dies mid-batch, Ray restarts the actor (``max_restarts``) and retries the batch
(``max_task_retries``); the new incarnation keeps the actor id, hence the same shard file, and
redoes only inputs without a journaled row.

An input that kills its process (an OOM kill, a segfault in a decoder) would be retried forever.
Each input is logged as started (``StartCounts``) before it runs, but a death alone names no input:
the inputs of several batches were in flight.  So an input started before without a row (in flight
at a death) runs alone, with nothing else of any batch running in the process (``AloneGate``), and
its start says so; a death while it runs is its own.  One that the process died under
``CRASH_LIMIT`` times while alone gets an error row (``crashed``) instead of another try:

    first start      side by side      a death names nobody; every input in flight is a suspect
    suspect          alone             a death is charged to it; after CRASH_LIMIT, its error row

An ordinary input is never charged for a death it did not cause: it runs side by side only at its
first start, and dies alone only of itself.  An input that kills the process costs at most
1 + CRASH_LIMIT deaths: its first start, side by side, and CRASH_LIMIT alone.  (A death that is
not the lone input's -- its machine lost, the kernel's OOM killer picking this process for another
one's memory -- is charged to it too: the limit leaves room for CRASH_LIMIT - 1 of those.)  A
marker without ``alone``, as replicas before it wrote, counts as a start side by side: a job
interrupted before it and resumed charges nobody for its old deaths.

The driver never receives the rows themselves: the merge reads them from the shards, so
object-store traffic is the small result rows.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from mm_pipeline.cluster.alone_gate import AloneGate
from mm_pipeline.jobs.job_output import JobOutput
from mm_pipeline.jobs.resume import RowKey
from mm_pipeline.jobs.shard_journal import ShardIndex, ShardJournal, StartCounts

# deaths of the process while one input ran alone in it (each one that input's) before it gets an
# error row instead of another try
CRASH_LIMIT = 2
# the result columns every replica returns (besides nothing else: the rows are in the shards)
RESULT_COLUMNS = ("key", "error", "tokens", "journaled", "replica", "node", "pid", "batch_start",
                  "batch_end", "cache")


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica needs; pickled to the actors, so paths must be valid on every node."""

    model_dir: str
    engine_config: Any  # OmniEngineConfig (device, Redis tiers...)
    output: JobOutput
    threads: int = 1  # torch intra-op threads: the replica's CPUs (one thread per replica in tests)

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


class JobReplica(ABC):
    """Base of the caption and batch replicas: engine, journal, index, the batch protocol.
    Subclasses give ``answer`` (one input -> its output row) and ``outcome`` (row -> (error, tokens))."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.replica_id, self.node = self.identity()
        self.pid = os.getpid()
        self.output = spec.output
        self.engine = self.load_engine(spec)
        # the actor id survives restarts, so a restarted replica appends to its predecessor's shard
        self.journal = ShardJournal(spec.output.shard_path(self.replica_id))
        self.index = ShardIndex(spec.output.parts_dir, spec.output.key, self.outcome)
        self.started = ShardJournal(spec.output.started_path(self.replica_id))
        self.starts = StartCounts(spec.output.parts_dir)
        self.gate = AloneGate()  # the inputs of every batch on this replica
        self._n = 0

    def identity(self) -> tuple[str, str]:
        """(replica id, node address): the Ray actor's id, which a restart keeps, and its node."""
        import ray

        return ray.get_runtime_context().get_actor_id() or f"pid{os.getpid()}", ray.util.get_node_ip_address()

    def load_engine(self, spec: ReplicaSpec) -> Any:
        import torch

        from mm_pipeline.runtime.omni_engine import OmniEngine

        torch.set_num_threads(spec.threads)
        return OmniEngine.from_pretrained(spec.model_dir, spec.engine_config)

    # ---- subclass interface -----------------------------------------------------------------
    @abstractmethod
    def keys(self, batch: dict[str, np.ndarray]) -> list[RowKey | None]:
        """The key of each input of ``batch``, as ``resume.row_key`` reads it from the input's row
        (None: an input that cannot be deduplicated)."""

    @abstractmethod
    async def answer(self, batch: dict[str, np.ndarray], i: int, n: int) -> dict[str, Any]:
        """The output row of input ``i`` of ``batch`` (``n``: unique in this process); never raises."""

    @abstractmethod
    def outcome(self, row: dict[str, Any]) -> tuple[str | None, int]:
        """(error message or None, completion tokens) of an output row."""

    @abstractmethod
    def crashed(self, batch: dict[str, np.ndarray], i: int, message: str) -> dict[str, Any]:
        """The error row of input ``i``, which took the replica's process down ``CRASH_LIMIT`` times
        while it ran alone."""

    # ---- the batch protocol -----------------------------------------------------------------
    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        start = time.time()
        self.starts.refresh()  # before the rows: a start counted here whose row came since is seen done
        self.index.refresh()
        keys = self.keys(batch)
        results: list[tuple[str | None, int, bool] | None] = [None] * len(keys)  # error, tokens, journaled
        todo: list[tuple[int, bool]] = []  # (input, runs alone)
        for i, key in enumerate(keys):
            if key is None:
                todo.append((i, False))
            elif key in self.index.rows:
                results[i] = (*self.index.rows[key], True)  # a retried batch: done before the death
            elif (deaths := self.starts.alone.get(key, 0)) >= CRASH_LIMIT:
                row = self.crashed(batch, i, f"the replica's process died {deaths} times while answering this input "
                                             f"alone (killed for memory, or a crash in native code); not retried")
                self.journal.append(row)
                results[i] = (*self.outcome(row), False)
            else:  # alone when it was in flight at a death (started, no row): a death now names it
                todo.append((i, key in self.starts.counts))

        async def run(i: int, alone: bool) -> None:
            async with self.gate.alone() if alone else self.gate.ordinary():
                self._n += 1
                if keys[i] is not None:  # before it runs: a death now makes it a suspect, or names it
                    self.started.append({"started": keys[i], "alone": True} if alone else {"started": keys[i]})
                row = await self.answer(batch, i, self._n)
                self.journal.append(row)  # before anything else can fail: this input is done
            results[i] = (*self.outcome(row), False)

        await asyncio.gather(*(run(i, alone) for i, alone in todo))
        self.journal.sync()
        end = time.time()
        cache = json.dumps(self.cache_counters())
        # the result's key column is text: a line number (a batch line without a custom_id) is ""
        return {"key": [k if isinstance(k, str) else "" for k in keys],
                "error": [r[0] or "" for r in results],
                "tokens": [r[1] for r in results],
                "journaled": [r[2] for r in results],
                "replica": [self.replica_id] * len(keys), "node": [self.node] * len(keys),
                "pid": [self.pid] * len(keys), "batch_start": [start] * len(keys),
                "batch_end": [end] * len(keys), "cache": [cache] * len(keys)}

    def cache_counters(self) -> dict[str, int]:
        from mm_pipeline.jobs.caption import cache_hits

        return cache_hits(self.engine)
