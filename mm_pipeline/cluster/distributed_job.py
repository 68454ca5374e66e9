"""The driver side of a job on Ray Data: replicas over a dataset, results streamed back, the merge.

    dataset of inputs ─► map_batches(ReplicaClass, ActorPoolStrategy(size=replicas), batch_size,
                                     num_cpus/num_gpus per replica, max_restarts, max_task_retries)
        ─► iter_batches (streaming: replicas keep working while the driver counts)
             per result row: progress, summary.add; per batch report: ReplicaStats.add_batch
    ─► JobOutput.merge(every input): each input once, or IncompleteJobError; streamed, and under
       the output's lock (JobOutput.lock), which the job holds from its done keys to here

Ray Data does the scheduling (actor pool, backpressure, retries); this module only wires it and
reads the results.  The caption and batch jobs build their input datasets
(``caption_dataset.py``, ``batch_dataset.py``) and call :func:`run_replicas`.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from mm_pipeline.cluster.job_replica import CRASH_LIMIT
from mm_pipeline.jobs.job_output import MergeReport
from mm_pipeline.jobs.progress import Progress
from mm_pipeline.jobs.replica_stats import ReplicaStats


@dataclass(frozen=True)
class RayJobConfig:
    replicas: int = 1  # captioning actors, one engine each
    cpus_per_replica: float = 1.0  # Ray resources of one replica (fractions are fine: tests use 0.5)
    gpus_per_replica: float = 0.0
    batch_size: int = 16  # inputs per batch handed to a replica; several batches run on it at once
    # Read tasks hold no Ray CPU: replicas that take every CPU (one per core is the natural setting)
    # would otherwise starve the reads that feed them, and the job would wait forever. They are
    # capped in number instead (read_tasks at once).
    read_tasks: int = 4
    # Bytes of inputs read ahead of each replica: the job's Ray Data object-store limit is
    # replicas x this, so read tasks wait while the replicas are that far behind (None: the job's
    # default, caption_dataset.default_read_ahead / batch_dataset's CHUNKS_IN_FLIGHT chunks).
    # Without it only Ray Data's own limit, half the object store, held reads back: behind slow
    # replicas, most of a big input sat read in the object store.
    read_ahead_bytes: int | None = None
    start_timeout_s: int = 600  # every replica must be up by then (else the job fails naming the wait)
    ray_progress: bool = False  # Ray Data's own progress bars / logs besides the job's progress

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.batch_size < 1:
            raise ValueError(f"replicas and batch_size must be >= 1, got {self.replicas}, {self.batch_size}")
        if self.start_timeout_s < 1:
            raise ValueError(f"start_timeout_s must be >= 1 s, got {self.start_timeout_s}")
        if self.cpus_per_replica <= 0 or self.gpus_per_replica < 0 or self.read_tasks < 1:
            raise ValueError(f"cpus_per_replica must be > 0, gpus_per_replica >= 0 and read_tasks >= 1, got "
                             f"{self.cpus_per_replica}, {self.gpus_per_replica}, {self.read_tasks}")
        r = self.read_ahead_bytes
        if r is not None and (isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1):
            raise ValueError(f"read_ahead_bytes must be a whole number of bytes >= 1 per replica "
                             f"(None: the job's default), got {r!r}")

    def object_store_bytes(self, default_read_ahead_bytes: int) -> int:
        """The job's object-store limit: ``read_ahead_bytes`` per replica, else the job's default."""
        return self.replicas * int(self.read_ahead_bytes or default_read_ahead_bytes)

    @property
    def threads(self) -> int:
        """torch threads of one replica: its whole CPUs (at least one)."""
        return max(1, int(self.cpus_per_replica))


@dataclass
class DistributedResult:
    replicas: list[ReplicaStats]
    results: int  # result rows the driver received (one per input it sent)
    duplicate_results: int  # keys the driver received twice (0 when exactly once held)
    journaled: int  # inputs a retried batch found already done (a replica died after writing them)
    merge: MergeReport | None = None

    def lines(self) -> list[str]:
        out = []
        if self.journaled:
            out.append(f"{self.journaled} inputs finished before a replica died were not redone")
        if self.merge is not None:
            m = self.merge
            out.append(f"merged {m.new_rows} new rows from {m.shards} shards; {m.rows} rows in the output, "
                       + ("each input once" if not (m.duplicates or self.duplicate_results) else
                          f"{m.duplicates + self.duplicate_results} duplicates dropped"))
        return out


def configure_data(config: RayJobConfig, default_read_ahead_bytes: int) -> None:
    """Ray Data settings of this driver, before the job's datasets are built (they copy them).
    The most job data Ray Data may hold in the object store, inputs read ahead of the replicas
    included, is ``config.object_store_bytes(default_read_ahead_bytes)`` (the job's default per
    replica unless ``config.read_ahead_bytes`` gives one); Ray Data keeps its own limit, half the
    object store, when that is smaller."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    # Work starts when every replica is up: otherwise the first to load its model takes the whole
    # queue while the others load (and a replica that cannot be placed fails the job instead of
    # leaving it to run at a fraction of its size unnoticed).
    ctx.wait_for_min_actors_s = config.start_timeout_s
    ctx.enable_progress_bars = config.ray_progress
    # Ray Data's backpressure with a byte limit: a read task starts only while the job's objects fit.
    # A read block bigger than the whole limit still runs (Ray 2.60: each operator's reservation is
    # at least one task's output, over the limit if need be, and when nothing runs one task may
    # start whatever the limit), so the job never waits for good; it then has that block alone in
    # flight.  (With a limit under about two read blocks, the read stage's end may wait up to 10 s,
    # Ray Data's idle check, when the last batch is a partial one.)
    # Ray Data learns a read's size from its first outputs: until then up to read_tasks reads start
    # at once.  Set every time: the context is the process's, and a job must not inherit the last
    # one's limit.
    limits = ctx.execution_options.resource_limits
    ctx.execution_options.resource_limits = limits.copy(
        object_store_memory=config.object_store_bytes(default_read_ahead_bytes))


def run_replicas(ds: Any, replica_cls: type, constructor_kwargs: dict[str, Any], config: RayJobConfig,
                 on_result: Callable[[str, str | None, int], None], progress: Progress | None = None
                 ) -> DistributedResult:
    """Map ``ds`` through ``replica_cls`` actors (built with ``constructor_kwargs``, a ``ReplicaSpec``
    among them) and stream the result rows to ``on_result(key, error, tokens)``; returns
    per-replica statistics (the caller merges the output)."""
    from ray.data import ActorPoolStrategy

    out = ds.map_batches(
        # a fixed pool of `replicas` actors (what `concurrency=N` spelled before Ray 2.51)
        replica_cls, fn_constructor_kwargs=constructor_kwargs, batch_size=config.batch_size,
        compute=ActorPoolStrategy(size=config.replicas), num_cpus=config.cpus_per_replica,
        num_gpus=config.gpus_per_replica or None,
        # a dead replica is restarted and its unfinished batches retried there (the journal makes
        # the retry redo only what has no row yet).  An input in flight at a death runs alone after
        # it, and one the process died under CRASH_LIMIT times while alone gets an error row
        # (job_replica.py), so an input costs at most 1 + CRASH_LIMIT deaths (its first start, side
        # by side, and its starts alone) and a batch needs at most that many tries per input of its
        # own and of the batches beside it on the replica (Ray Data runs up to 4 at once): past
        # that, the job fails instead of retrying for good
        max_restarts=-1, max_task_retries=(1 + CRASH_LIMIT) * config.batch_size * 4 + 1)
    # A replica batch's report rides on each of its rows.  It is folded into that replica's stats
    # block by block as results arrive: per batch the driver keeps only its timeline span, not a
    # record with its decoded cache counters until the end (~1 KB each; a 10M-line job has 600K
    # batches).  Ray may join batches into one block (grouped here) or split one (add_batch adds pieces).
    replicas: dict[str, ReplicaStats] = {}
    seen: set[str] = set()
    result = DistributedResult(replicas=[], results=0, duplicate_results=0, journaled=0)
    for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
        groups: dict[tuple[str, int, float], list[int]] = {}  # (replica, pid, start) -> [items, failed, a row]
        for i in range(len(batch["key"])):
            key, error, tokens = str(batch["key"][i]), str(batch["error"][i]) or None, int(batch["tokens"][i])
            result.results += 1
            if key:
                if key in seen:
                    result.duplicate_results += 1
                    continue
                seen.add(key)
            result.journaled += int(batch["journaled"][i])
            on_result(key, error, tokens)
            g = groups.setdefault((str(batch["replica"][i]), int(batch["pid"][i]), float(batch["batch_start"][i])),
                                  [0, 0, i])
            g[0] += 1
            g[1] += int(error is not None)
            if progress is not None:
                progress.advance(1, failed=int(error is not None))
        for (rid, pid, start), (items, failed, i) in groups.items():
            replicas.setdefault(rid, ReplicaStats(rid)).add_batch(
                node=str(batch["node"][i]), pid=pid, start=start, end=float(batch["batch_end"][i]),
                items=items, failed=failed, cache=json.loads(str(batch["cache"][i])))
    result.replicas = list(replicas.values())
    return result
