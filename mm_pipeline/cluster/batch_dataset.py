"""``mmserve batch --ray``: an OpenAI Batch file answered by replicas on Ray Data.

    input lines whose custom_id has no output line yet (JobOutput.done_keys)
      ─► ray.data.from_items((line number, raw line))
      ─► map_batches(BatchReplica)  actors, one engine each, lines journaled to shards
      ─► driver: progress, summary, per-replica stats ─► JobOutput.merge (each custom_id once)
    the output's lock (JobOutput.lock) held from the done keys to the merge

Lines are parsed on the replicas (``parse_line``, never raises), so a broken line is an error
line in the output, as without ``--ray``.  The driver reads the file a line at a time and keeps the
lines still to answer (``from_items`` hands them to Ray) and every custom_id: an OpenAI batch file
(at most a few hundred MB) fits a driver's memory; its bodies are not parsed there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mm_pipeline.cluster.batch_replica import BatchReplica
from mm_pipeline.cluster.distributed_job import DistributedResult, RayJobConfig, configure_data, run_replicas
from mm_pipeline.cluster.job_replica import ReplicaSpec
from mm_pipeline.jobs.batch import BatchSummary, input_lines
from mm_pipeline.jobs.progress import Progress


def run_batch_on_ray(ray: Any, in_path: Path, spec: ReplicaSpec, config: RayJobConfig,
                     default_max_tokens: int = 512) -> tuple[BatchSummary, DistributedResult]:
    """Answer ``in_path`` (resuming ``spec.output``) on the connected Ray cluster, then merge (under
    the output's lock, as ``run_caption_on_ray``)."""
    with spec.output.lock():
        done = spec.output.done_keys()
        total, todo, expected = 0, [], []
        for n, raw, cid in input_lines(in_path):  # a line at a time: done lines are not kept
            total += 1
            if cid is not None:
                expected.append(cid)
            if cid is None or cid not in done:
                todo.append({"number": n, "raw": raw})
        summary = BatchSummary(total=total, skipped=total - len(todo))
        progress = Progress(len(todo), "batch")
        start = time.perf_counter()
        result = DistributedResult(replicas=[], results=0, duplicate_results=0, journaled=0)
        if todo:
            configure_data(config)
            result = run_replicas(ray.data.from_items(todo), BatchReplica,
                                  {"spec": spec, "default_max_tokens": default_max_tokens}, config,
                                  on_result=lambda key, error, tokens: summary.add(key or None, error),
                                  progress=progress)
        del todo  # the merge needs none of the lines: their memory is free before it runs
        progress.close()
        summary.elapsed_s = time.perf_counter() - start
        summary.replicas = result.replicas
        result.merge = spec.output.merge(expected)
    return summary, result
