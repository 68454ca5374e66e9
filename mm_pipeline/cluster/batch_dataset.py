"""``mmserve batch --ray``: an OpenAI Batch file answered by replicas on Ray Data, the file streamed.

    input file ─► driver, one pass a line at a time (plan_input): counts, the keys the merge checks
                  (custom_ids; line numbers of lines without one), and the byte ranges ("chunks") of the lines still to answer
      ─► ray.data.from_items(chunks, a block each)                     three numbers per chunk
      ─► map_batches(read_chunks)   IO tasks, no Ray CPU: a chunk's lines read from the file
      ─► map_batches(BatchReplica)  actors, one engine each, lines journaled to shards
      ─► driver: progress, summary, per-replica stats ─► JobOutput.merge (each custom_id once)
    the output's lock (JobOutput.lock) held from the done keys to the merge

The driver never holds the lines: the replicas get them from read tasks, which Ray Data runs as the
replicas need more (its backpressure, with the job's byte limit: CHUNKS_IN_FLIGHT chunks a replica,
or ``read_ahead_bytes``), so the lines in flight are a few chunks per replica, whatever the file's
size.  What the driver keeps grows only with the keys, as the merge needs them (see
job_output.py): the lines' keys, one small record per chunk, the result keys it has seen.
Lines are parsed on the replicas (``parse_line``, never raises), so a broken line is an error line
in the output, as without ``--ray``.  The input must not change while the job runs: the chunks are
byte ranges of the file the plan read (a line that went missing is named by the merge).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Container, Iterator

import numpy as np

from mm_pipeline.cluster.batch_replica import BatchReplica
from mm_pipeline.cluster.distributed_job import DistributedResult, RayJobConfig, configure_data, run_replicas
from mm_pipeline.cluster.job_replica import ReplicaSpec
from mm_pipeline.jobs.batch import BatchSummary
from mm_pipeline.server.batches.lines import decode_line, line_key
from mm_pipeline.jobs.progress import Progress
from mm_pipeline.jobs.resume import RowKey

# A chunk is at most this many bytes of the file or CHUNK_BATCHES replica batches of lines: it is
# one read task and one block, so this bounds the lines one read holds and what a replica is
# handed at once.  Far smaller would cost a Ray task per few lines (ms each); far larger would
# leave one replica with the tail of the file while the others idle.
CHUNK_BYTES = 4 << 20
CHUNK_BATCHES = 64
# Chunks read ahead of the replicas, per replica, by default: the job's object-store limit is
# replicas x this x CHUNK_BYTES (64 MB a replica; RayJobConfig.read_ahead_bytes, --read-ahead-mb,
# sets another), so reads wait while the replicas are behind.  Ray Data's own limit,
# a share of the object store, let the reads run far ahead: behind a slow replica, 146 MB of a
# 150 MB file sat read and unanswered at once, and a 10 GB one would fill the store.  Sixteen chunks
# keep several batches queued on every replica (Ray Data sends each a few blocks at a time).
CHUNKS_IN_FLIGHT = 16


@dataclass(frozen=True)
class ChunkLimits:
    lines: int = 16 * CHUNK_BATCHES  # lines to answer in one chunk
    bytes: int = CHUNK_BYTES  # a longer line makes a chunk of its own

    def __post_init__(self) -> None:
        if self.lines < 1 or self.bytes < 1:
            raise ValueError(f"chunk limits must be >= 1, got {self.lines} lines, {self.bytes} bytes")


@dataclass(frozen=True)
class LineChunk:
    """Consecutive lines of the input to answer: bytes [start, end) of the file, whose first line is
    line ``first_line`` (1-based, blank lines counted, as ``input_lines`` numbers them)."""

    start: int
    end: int
    first_line: int


@dataclass
class InputPlan:
    total: int = 0  # non-blank lines
    skipped: int = 0  # of them, lines that already have an output row
    # every line's key (its custom_id, else its line number: resume.row_key), in file order (the merge's)
    expected: list[RowKey] = field(default_factory=list)
    chunks: list[LineChunk] = field(default_factory=list)  # the lines to answer, every one in one chunk


def plan_input(path: Path, done: Container[RowKey], limits: ChunkLimits = ChunkLimits()) -> InputPlan:
    """One pass over ``path``, a line at a time: a line whose key is in ``done`` is skipped (it ends
    the chunk before it), every other non-blank line falls in a chunk, in file order.  A line's key
    is its custom_id, or for a line without one (broken: its row is an error naming the line) its
    line number, as ``batch`` without ``--ray`` knows it (``line_key``)."""
    plan = InputPlan()
    start = first = lines = end = 0  # the open chunk: its range so far and pending lines (0: none open)
    offset = 0

    def close() -> None:
        nonlocal lines
        if lines:
            plan.chunks.append(LineChunk(start, end, first))
            lines = 0

    with path.open("rb") as f:
        for n, line in enumerate(f, 1):  # binary-mode iteration: split on b"\n" only, as input_lines
            at, offset = offset, offset + len(line)
            raw = decode_line(line)
            if raw is None:
                continue  # blank: inside a chunk the reader passes over it too
            plan.total += 1
            key = line_key(n, raw)
            plan.expected.append(key)
            if key in done:
                plan.skipped += 1
                close()
                continue
            if lines and offset - start > limits.bytes:
                close()  # this line would take the chunk past its bytes: it starts the next one
            if not lines:
                start, first = at, n
            lines, end = lines + 1, offset
            if lines >= limits.lines:
                close()
    close()
    return plan


def chunk_lines(path: str, chunk: LineChunk) -> Iterator[tuple[int, bytes]]:
    """(line number, the line's bytes) of the non-blank lines of ``chunk``, read a line at a time."""
    with open(path, "rb") as f:
        f.seek(chunk.start)
        n, at = chunk.first_line, chunk.start
        while at < chunk.end:
            line = f.readline()
            if not line:
                return  # the file shrank since the plan: the merge names the lines that never ran
            if decode_line(line) is not None:
                yield n, line
            n, at = n + 1, at + len(line)


def read_chunks(batch: dict[str, np.ndarray], path: str) -> dict[str, list]:
    """The read stage: the lines of a batch of chunks (one, as the job builds it).  The raw bytes
    travel (an Arrow binary column holds any line, UTF-8 or not); the replica decodes them."""
    numbers: list[int] = []
    raws: list[bytes] = []
    for start, end, first in zip(batch["start"], batch["end"], batch["first_line"]):
        for n, line in chunk_lines(path, LineChunk(int(start), int(end), int(first))):
            numbers.append(n)
            raws.append(line)
    return {"number": numbers, "raw": raws}


def run_batch_on_ray(ray: Any, in_path: Path, spec: ReplicaSpec, config: RayJobConfig,
                     default_max_tokens: int | None = None,
                     reasoning_parser: str = "auto",
                     tool_call_parser: str = "auto") -> tuple[BatchSummary, DistributedResult]:
    """Answer ``in_path`` (resuming ``spec.output``) on the connected Ray cluster, then merge (under
    the output's lock, as ``run_caption_on_ray``)."""
    with spec.output.lock():
        # the done keys live only through the plan's pass: the run needs the chunks, the merge the
        # expected keys (and it reads the done ones again itself)
        plan = plan_input(in_path, spec.output.done_keys(), ChunkLimits(lines=config.batch_size * CHUNK_BATCHES))
        summary = BatchSummary(total=plan.total, skipped=plan.skipped)
        progress = Progress(plan.total - plan.skipped, "batch")
        start = time.perf_counter()
        result = DistributedResult(replicas=[], results=0, duplicate_results=0, journaled=0)
        if plan.chunks:
            configure_data(config, CHUNKS_IN_FLIGHT * CHUNK_BYTES)
            # a block per chunk, so each is its own read task: one task reading several would hand
            # Ray Data all their lines as one block (it joins a task's output up to 128 MB)
            ds = ray.data.from_items([asdict(c) for c in plan.chunks], override_num_blocks=len(plan.chunks))
            # reads hold no Ray CPU (replicas may take every one, as in the caption job); they open
            # the file by absolute path, valid on every machine that mounts it
            ds = ds.map_batches(read_chunks, batch_size=None, num_cpus=0,
                                fn_kwargs={"path": os.path.abspath(in_path)},
                                compute=ray.data.TaskPoolStrategy(size=config.read_tasks))
            plan.chunks = []  # Ray holds them now
            result = run_replicas(ds, BatchReplica, {"spec": spec, "default_max_tokens": default_max_tokens,
                                                         "reasoning_parser": reasoning_parser,
                                                         "tool_call_parser": tool_call_parser},
                                  config, on_result=lambda key, error, tokens: summary.add(key or None, error),
                                  progress=progress)
        progress.close()
        summary.elapsed_s = time.perf_counter() - start
        summary.replicas = result.replicas
        result.merge = spec.output.merge(plan.expected)
    return summary, result
