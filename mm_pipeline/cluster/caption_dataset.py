"""``mmserve caption --ray``: the caption job as a Ray Data pipeline.

    inputs not yet in the output (JobOutput.done_keys: final file + every shard)
      ─► ray.data.from_items                                          (the driver's list of paths)
      ─► map_batches(read_batch)      IO tasks: read bytes, sniff, blake3  (jobs/media_input.py)
      ─► map_batches(CaptionReplica)  actors, one engine each, rows journaled to shards
      ─► driver: progress, summary, per-replica stats ─► JobOutput.merge (each input once)
    the output's lock (JobOutput.lock) held from the done keys to the merge

The reads run ahead of the replicas by at most ``read_ahead_bytes`` of media per replica (the job's
Ray Data object-store limit; ``--read-ahead-mb``, default :func:`default_read_ahead`): behind slow
replicas, read tasks wait instead of reading the whole input into the object store.

A file that cannot be read travels as an error (``read_error``) and becomes the same error row
the single-process job writes; nothing in a batch can fail the job.  The replicas are the
single-process job's code (``CaptionJob.caption_input``), so the rows are the same.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from mm_pipeline.cluster.caption_replica import CaptionReplica
from mm_pipeline.cluster.distributed_job import DistributedResult, RayJobConfig, configure_data, run_replicas
from mm_pipeline.cluster.job_replica import ReplicaSpec
from mm_pipeline.jobs.caption import CaptionConfig, CaptionSummary
from mm_pipeline.jobs.job_output import JobOutput
from mm_pipeline.jobs.media_input import read_media_input
from mm_pipeline.jobs.progress import Progress

# Media read ahead of each replica by default (RayJobConfig.read_ahead_bytes; --read-ahead-mb).
# Without a limit of the job's own, Ray Data's (half the object store) let the reads run ahead of
# slow replicas until nearly the whole input sat in the object store (18 of 24 inputs in
# test_jobs_on_ray; a directory of videos: up to half the store).  512 MiB is two batches of 16
# inputs of 16 MiB (photos, short clips), thirty of 1 MiB photos: enough queued for the batches a
# replica runs at once, read while it captions.  A batch of bigger media than fits still goes
# through, alone (see configure_data); raise the limit, or lower --batch-size, to keep several
# such batches in flight.
READ_AHEAD_BYTES = 512 << 20


def default_read_ahead(max_bytes: int | None) -> int:
    """Bytes of media read ahead of each replica unless the job says: :data:`READ_AHEAD_BYTES`, or
    two inputs at the engine's media byte limit (``max_bytes``) when that is more, so a replica
    can caption one input at the limit while the next is read."""
    return max(READ_AHEAD_BYTES, 2 * (max_bytes or 0))


def read_batch(batch: dict[str, np.ndarray], max_bytes: int | None = None) -> dict[str, list]:
    """The read stage: one Ray task reads a batch of paths (never raises; see MediaInput); a file
    over ``max_bytes`` (the engine's media byte limit) is refused before it is read."""
    items = [read_media_input(str(name), str(path), max_bytes) for name, path in zip(batch["input"], batch["path"])]
    return {"input": [m.path for m in items],
            "data": [m.data or b"" for m in items],
            "kind": [m.kind.value if m.kind else "" for m in items],
            "content_hash": [m.content_hash or "" for m in items],
            "read_s": [m.read_s for m in items],
            "read_error": [m.error or "" for m in items]}


def run_caption_on_ray(ray: Any, inputs: list[str], spec: ReplicaSpec, caption: CaptionConfig,
                       config: RayJobConfig, progress_label: str = "caption"
                       ) -> tuple[CaptionSummary, DistributedResult]:
    """Caption ``inputs`` (resuming ``spec.output``) on the connected Ray cluster; merges the output
    (raises ``IncompleteJobError`` if an input has no row, which a re-run finishes, and
    ``OutputFileError`` if another job holds the output's lock)."""
    output: JobOutput = spec.output
    # the output's lock for the whole run, as the single-process job holds it: a second job on the
    # same output fails here, before it reads the done keys or starts a replica
    with output.lock():
        done = output.done_keys()
        todo = [p for p in inputs if p not in done]
        summary = CaptionSummary(total=len(inputs), skipped=len(inputs) - len(todo))
        progress = Progress(len(todo), progress_label)
        start = time.perf_counter()
        if todo:
            configure_data(config, default_read_ahead(spec.engine_config.limits.max_bytes))
            # inputs keep the names the user gave (the rows' "input", as without --ray); the read
            # stage opens them by absolute path, valid on every machine that mounts the same paths
            ds = ray.data.from_items([{"input": p, "path": os.path.abspath(p)} for p in todo])
            # reads overlap captioning; they hold no Ray CPU, so they never wait behind the replicas
            # for one, only for room under the job's object-store limit (read_ahead_bytes a replica)
            ds = ds.map_batches(read_batch, batch_size=config.batch_size, num_cpus=0,
                                fn_kwargs={"max_bytes": spec.engine_config.limits.max_bytes},
                                compute=ray.data.TaskPoolStrategy(size=config.read_tasks))
            result = run_replicas(ds, CaptionReplica, {"spec": spec, "caption": caption}, config,
                                  on_result=summary.add, progress=progress)
        else:
            result = DistributedResult(replicas=[], results=0, duplicate_results=0, journaled=0)
        progress.close()
        summary.elapsed_s = time.perf_counter() - start
        summary.replicas = result.replicas
        for r in result.replicas:
            for k, v in r.cache.items():
                summary.cache[k] = summary.cache.get(k, 0) + v
        result.merge = output.merge(inputs)
    return summary, result
