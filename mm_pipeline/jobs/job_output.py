"""The output of a sharded job: the final file, the shards replicas write beside it, and the merge
that ends the job.

    --out captions.jsonl  ->  captions.jsonl.parts/shard-*.jsonl   while the job runs
                              captions.jsonl (or .parquet)          after the merge; parts removed

Resume reads both (``done_keys``): rows of an earlier finished run in the final file and rows of
an interrupted run still in the shards.  ``merge`` is the exactly-once check: it takes the final
file's rows, then the shards' rows, keeps the first row of each key (a later copy is counted in
``duplicates``), refuses to finish while an expected key has no row (the parts stay for a re-run),
and replaces the final file atomically.  Rows without a key (batch lines with no custom_id) cannot
be deduplicated and are all kept, as the single-process batch job keeps them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from mm_pipeline.jobs.resume import done_keys as jsonl_done_keys
from mm_pipeline.jobs.shard_journal import SHARD_GLOB, read_rows

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
        if self.format == "parquet" and self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb") as f:
                if f.read(4) != b"PAR1":  # appending Parquet rows to a JSONL file would lose them
                    raise ValueError(f"{self.path} exists and is not a Parquet file")

    @property
    def parts_dir(self) -> Path:
        return self.path.with_name(self.path.name + ".parts")

    def shard_path(self, name: str) -> Path:
        return self.parts_dir / f"shard-{name}.jsonl"

    def shard_paths(self) -> list[Path]:
        return sorted(self.parts_dir.glob(SHARD_GLOB)) if self.parts_dir.is_dir() else []

    def done_keys(self) -> set[str]:
        """Keys with a row in the final file or in any shard."""
        done = self._final_keys()
        for shard in self.shard_paths():
            done |= jsonl_done_keys(shard, self.key)
        return done

    def merge(self, expected: Iterable[str]) -> MergeReport:
        """Final rows + shard rows -> the final file, each key once, new rows in ``expected``'s order.
        Raises ``IncompleteJobError`` naming the keys of ``expected`` that have no row."""
        order = {k: i for i, k in enumerate(expected)}
        old = self._final_rows()
        shards = self.shard_paths()
        new = [row for shard in shards for row in read_rows(shard)]
        seen: set[str] = set()
        kept: list[dict] = []
        duplicates = 0
        for row in old + sorted(new, key=lambda r: order.get(r.get(self.key), len(order))):
            k = row.get(self.key)
            if isinstance(k, str):
                if k in seen:
                    duplicates += 1
                    continue
                seen.add(k)
            kept.append(row)
        missing = [k for k in order if k not in seen]
        if missing:
            raise IncompleteJobError(f"{len(missing)} inputs have no output row (first: {missing[0]!r}); "
                                     f"the rows so far stay in {self.parts_dir}: run the job again to finish")
        self._write(kept)
        if self.parts_dir.is_dir():
            shutil.rmtree(self.parts_dir)
        return MergeReport(rows=len(kept), new_rows=len(kept) - len(old), duplicates=duplicates,
                           shards=len(shards))

    # ---- the final file -----------------------------------------------------------------------
    def _final_keys(self) -> set[str]:
        if self.format == "jsonl":
            return jsonl_done_keys(self.path, self.key)
        if not self.path.exists():
            return set()
        import pyarrow.parquet as pq

        return {k for k in pq.read_table(self.path, columns=[self.key]).column(self.key).to_pylist()
                if isinstance(k, str)}

    def _final_rows(self) -> list[dict]:
        if self.format == "jsonl":
            return read_rows(self.path)
        if not self.path.exists():
            return []
        import pyarrow.parquet as pq

        return pq.read_table(self.path).to_pylist()

    def _write(self, rows: list[dict]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.merging")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.format == "jsonl":
            with tmp.open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, self.path)  # readers see the old file or the merged one, never half of it
