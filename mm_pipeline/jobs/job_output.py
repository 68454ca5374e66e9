"""The output of a sharded job: the final file, the shards replicas write beside it, and the merge
that ends the job.

    --out captions.jsonl  ->  captions.jsonl.parts/shard-*.jsonl   while the job runs
                              captions.jsonl (or .parquet)          after the merge; parts removed

Resume reads both (``done_keys``): rows of an earlier finished run in the final file and rows of
an interrupted run still in the shards.  ``merge`` is the exactly-once check: it takes the final
file's rows, then the shards' rows, keeps the first row of each key (a later copy is counted in
``duplicates``), refuses to finish while an expected key has no row (the parts stay for a re-run),
and replaces the final file atomically.  A row's key is ``resume.row_key``: its key field, or for a
batch line without a custom_id the input line number its error names, as the single-process batch
job knows it; rows naming no input at all are all kept.

Everything here streams rows (``resume.iter_lines``): a job's driver holds its keys (and where each
new row lies in its shard), never its rows.  The merge reads the keys first, then writes the rows,
each read again from its file when its turn comes.  A job holds the final file's lock (``lock``)
from before it reads the done keys until the merge has replaced the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, TextIO

from mm_pipeline.jobs.resume import RowKey, done_keys as jsonl_done_keys
from mm_pipeline.jobs.resume import check_format, iter_lines, iter_rows, open_output, parse_row, row_bytes, row_key
from mm_pipeline.jobs.shard_journal import SHARD_GLOB

OutputFormat = Literal["jsonl", "parquet"]


class IncompleteJobError(RuntimeError):
    """The merge found inputs without a row: the job must run again (it resumes)."""


@dataclass(frozen=True)
class MergeReport:
    rows: int  # rows in the final file
    new_rows: int  # of them, rows this merge took from the shards
    duplicates: int  # rows dropped because their key already had one (0 when exactly once held)
    shards: int


@dataclass(frozen=True)
class JobOutput:
    path: Path
    key: str  # the field that names an input: "input" (caption) or "custom_id" (batch)
    format: OutputFormat = "jsonl"

    def __post_init__(self) -> None:
        if self.format not in ("jsonl", "parquet"):
            raise ValueError(f"output format must be jsonl or parquet, got {self.format!r}")
        # the merge replaces the file with its rows and ours: a file in the other format would
        # be read as no rows and lost (OutputFileError, a ValueError: a usage error)
        check_format(self.path, self.format)

    @property
    def parts_dir(self) -> Path:
        return self.path.with_name(self.path.name + ".parts")

    def shard_path(self, name: str) -> Path:
        return self.parts_dir / f"shard-{name}.jsonl"

    def started_path(self, name: str) -> Path:
        """The replica's log of inputs it started (``shard_journal.StartCounts``); not a shard."""
        return self.parts_dir / f"started-{name}.jsonl"

    def shard_paths(self) -> list[Path]:
        return sorted(self.parts_dir.glob(SHARD_GLOB)) if self.parts_dir.is_dir() else []

    def lock(self) -> TextIO:
        """The final file opened (created when missing) and locked until closed: ``resume.open_output``,
        the lock a single-process job holds, so two jobs writing one output fail the second with the
        same ``OutputFileError``.  Nothing is written through it: the merge replaces the file whole,
        the new file locked before it takes the name (see ``merge``)."""
        held = open_output(self.path, end_torn_line=False)
        try:
            check_format(self.path, self.format)  # again under the lock: the file may have changed
        except ValueError:
            held.close()
            raise
        return held

    def done_keys(self) -> set[RowKey]:
        """Keys with a row in the final file or in any shard."""
        done = {k for k in self._final_keys() if k is not None}
        for shard in self.shard_paths():
            done |= jsonl_done_keys(shard, self.key)
        return done

    def merge(self, expected: Iterable[RowKey]) -> MergeReport:
        """Final rows + shard rows -> the final file, each key once, new rows in ``expected``'s order.
        Raises ``IncompleteJobError`` naming the keys of ``expected`` that have no row."""
        order = {k: i for i, k in enumerate(expected)}
        shards = self.shard_paths()
        # pass 1, keys only: which final rows stay, and where the first shard row of each new key is
        old: set[RowKey] = set()
        old_rows = duplicates = 0
        for k in self._final_keys():
            if k is not None:
                if k in old:
                    duplicates += 1
                    continue
                old.add(k)
            old_rows += 1
        first: dict[RowKey, tuple[int, int]] = {}  # key -> (shard number, offset of its line)
        for i, shard in enumerate(shards):
            for offset, row in _shard_rows(shard):
                k = row_key(row, self.key)
                if k is not None:
                    if k in old or k in first:
                        duplicates += 1
                    else:
                        first[k] = (i, offset)
        missing = [k for k in order if k not in old and k not in first]
        if missing:
            raise IncompleteJobError(f"{len(missing)} inputs have no output row (first: {_named(missing[0])}); "
                                     f"the rows so far stay in {self.parts_dir}: run the job again to finish")
        # pass 2: the rows, streamed into a new file that then takes the final file's name
        rows = self._write(lambda: self._merged_rows(shards, order, first))
        tmp = self._tmp_path()
        with tmp.open("rb") as held:
            # the new file is locked before it takes the name: the job's lock (on the old file)
            # passes to it with no moment where another job could take the output
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            os.replace(tmp, self.path)  # readers see the old file or the merged one, never half of it
            if self.parts_dir.is_dir():
                shutil.rmtree(self.parts_dir)
        return MergeReport(rows=rows, new_rows=rows - old_rows, duplicates=duplicates, shards=len(shards))

    def final_rows(self) -> Iterator[dict]:
        """The final file's rows, streamed (torn or foreign JSONL lines skipped)."""
        if self.format == "jsonl":
            yield from iter_rows(self.path)
        elif self._has_parquet():
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(self.path).iter_batches(batch_size=_CHUNK):
                yield from batch.to_pylist()

    # ---- the merge's pieces -------------------------------------------------------------------
    def _final_keys(self) -> Iterator[RowKey | None]:
        """The ``row_key`` of each final row (None where it has none).  Parquet: the key column (only
        caption writes Parquet, and its rows all name their input)."""
        if self.format == "jsonl":
            yield from (row_key(row, self.key) for row in iter_rows(self.path))
        elif self._has_parquet():
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(self.path).iter_batches(batch_size=_CHUNK * 8, columns=[self.key]):
                yield from (k if isinstance(k, str) else None for k in batch.column(0).to_pylist())

    def _has_parquet(self) -> bool:
        # empty: created by ``lock`` before any merge wrote it
        return self.path.exists() and self.path.stat().st_size > 0

    def _merged_rows(self, shards: list[Path], order: dict[RowKey, int],
                     first: dict[RowKey, tuple[int, int]]) -> Iterator[dict]:
        """The merged file's rows: the final file's (first of each key), then the new keys' rows in
        ``order``, then shard rows of no expected key (those naming no input, all kept) in shard order."""
        seen: set[RowKey] = set()
        for row in self.final_rows():
            k = row_key(row, self.key)
            if k is not None:
                if k in seen:
                    continue
                seen.add(k)
            yield row
        del seen
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(shard.open("rb")) for shard in shards]
            for k in order:
                if (at := first.get(k)) is not None:
                    files[at[0]].seek(at[1])
                    _, line = next(iter_lines(files[at[0]]))
                    yield parse_row(line)
            for i, f in enumerate(files):
                f.seek(0)
                for offset, line in iter_lines(f):
                    if (row := parse_row(line)) is None:
                        continue
                    k = row_key(row, self.key)
                    if k is None or (k not in order and first.get(k) == (i, offset)):
                        yield row

    def _tmp_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.merging")

    def _write(self, rows: Callable[[], Iterator[dict]]) -> int:
        """Write ``rows()`` to the merge's temporary file; the number of rows.  Parquet takes two
        passes: the schema of all rows (a column null in early rows and set later, a timings struct
        with more fields later), then the rows, a chunk at a time."""
        tmp = self._tmp_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        if self.format == "jsonl":
            with tmp.open("wb") as f:
                for row in rows():
                    f.write(row_bytes(row))
                    n += 1
            return n
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = None
        for chunk in _chunks(rows()):
            got = pa.Table.from_pylist(chunk).schema
            schema = got if schema is None else pa.unify_schemas([schema, got], promote_options="permissive")
        with pq.ParquetWriter(tmp, schema if schema is not None else pa.schema([])) as writer:
            for chunk in _chunks(rows()):
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                n += len(chunk)
        return n


_CHUNK = 8192  # Parquet rows converted at once (one row group each; a caption row is ~1 KB)


def _chunks(rows: Iterator[dict]) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == _CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _named(key: RowKey) -> str:
    return f"line {key}" if isinstance(key, int) else repr(key)


def _shard_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(offset, row) of each well-formed line of a shard, streamed."""
    with path.open("rb") as f:
        for offset, line in iter_lines(f):
            if (row := parse_row(line)) is not None:
                yield offset, row
