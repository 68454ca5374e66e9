"""``mmserve batch --ray``: an OpenAI Batch file answered by replicas on Ray Data.

    input lines whose custom_id has no output line yet (JobOutput.done_keys)
      ─► ray.data.from_items((line number, raw line))
      ─► map_batches(BatchReplica)  actors, one engine each, lines journaled to shards
      ─► driver: progress, summary, per-replica stats ─► JobOutput.merge (each custom_id once)

Lines are parsed on the replicas (``parse_line``, never raises), so a broken line is an error
line in the output, as without ``--ray``.  The file is listed by the driver: an OpenAI batch file
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
    """Answer ``in_path`` (resuming ``spec.output``) on the connected Ray cluster, then merge."""
    done = spec.output.done_keys()
    lines = list(input_lines(in_path))
    todo = [{"number": n, "raw": raw} for n, raw, cid in lines if cid is None or cid not in done]
    summary = BatchSummary(total=len(lines), skipped=len(lines) - len(todo))
    progress = Progress(len(todo), "batch")
    start = time.perf_counter()
    result = DistributedResult(replicas=[], results=0, duplicate_results=0, journaled=0)
    if todo:
        configure_data(config)
        result = run_replicas(ray.data.from_items(todo), BatchReplica,
                              {"spec": spec, "default_max_tokens": default_max_tokens}, config,
                              on_result=lambda key, error, tokens: summary.add(key or None, error),
                              progress=progress)
    progress.close()
    summary.elapsed_s = time.perf_counter() - start
    summary.replicas = result.replicas
    result.merge = spec.output.merge([cid for _, _, cid in lines if cid is not None])
    return summary, result
