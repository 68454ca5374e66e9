"""Shards of a distributed job's output: one append-only JSONL journal per replica, and an index of
every row all replicas have journaled so far.

    captions.jsonl.parts/
        shard-<replica id>.jsonl     one row per finished input, flushed as it finishes
        started-<replica id>.jsonl   {"started": key} as each input starts, with "alone": true
                                     when nothing else ran in the process (``StartCounts``)

A replica appends a row the moment its input finishes, so when its process dies mid-batch the
finished rows survive and Ray's retry of the batch (on the restarted replica, or any other) finds
them in the ``ShardIndex`` and redoes only the rest.  The index tails every shard incrementally
(it remembers how far it read each file and reads only whole lines, one at a time), so checking a
batch costs the bytes written since the last check, not the whole output, and its memory is the
index's.  Every replica must see the same parts directory: on several machines it is a shared
filesystem path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

from mm_pipeline.jobs.resume import RowKey, iter_lines, parse_row, row_bytes, row_key

SHARD_GLOB = "shard-*.jsonl"
STARTED_GLOB = "started-*.jsonl"


class ShardJournal:
    """Appends rows to one shard file (created on first use; a torn last line left by a killed
    predecessor is closed off so the next row starts on a fresh line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("ab")
        if self._f.tell() and not _ends_with_newline(path):
            self._f.write(b"\n")

    def append(self, row: dict[str, Any]) -> None:
        self._f.write(row_bytes(row))  # as the final file's rows: a non-UTF-8 name does not end the replica
        self._f.flush()  # visible to other processes (and surviving this one's death) at once

    def sync(self) -> None:
        """Make the rows durable against a machine crash too (once per batch: an fsync per row
        would cost more than a tiny model's caption)."""
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class _Tail:
    """The rows appended to the files ``parts_dir/<glob>`` since the last ``new_rows``."""

    def __init__(self, parts_dir: Path, glob: str) -> None:
        self.parts_dir = parts_dir
        self.glob = glob
        self._offsets: dict[Path, int] = {}

    def new_rows(self) -> Iterator[dict]:
        if not self.parts_dir.is_dir():
            return
        for path in sorted(self.parts_dir.glob(self.glob)):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                # a line at a time (resume.iter_lines): memory for the index, not for the shards
                for _, line in iter_lines(f):
                    if line is not None and not line.endswith(b"\n"):
                        break  # a line still being written waits for the next refresh
                    # (a line over MAX_ROW_BYTES is None: not a row, passed over like a torn one)
                    self._offsets[path] = f.tell()
                    if (row := parse_row(line)) is not None:
                        yield row


class ShardIndex:
    """``key -> outcome`` of every row in the shards of ``parts_dir``; ``refresh`` reads what was
    appended since the last call.  ``outcome`` maps a row to what the index keeps (a small value:
    the index of a million-row job lives in every replica)."""

    def __init__(self, parts_dir: Path, key: str, outcome: Callable[[dict], Any] = lambda row: None) -> None:
        self.parts_dir = parts_dir
        self.key = key
        self.outcome = outcome
        self.rows: dict[RowKey, Any] = {}  # resume.row_key -> outcome
        self._tail = _Tail(parts_dir, SHARD_GLOB)

    def refresh(self) -> None:
        for row in self._tail.new_rows():
            if (k := row_key(row, self.key)) is not None:
                self.rows.setdefault(k, self.outcome(row))


class StartCounts:
    """How many times each input was started, by every replica and every incarnation of one: the
    ``{"started": key}`` markers a replica journals (``ShardJournal``) before it answers an input.
    An input started more often than it has rows was in flight when its replica's process died;
    ``alone`` counts the starts marked ``"alone": true``, when it was the only input running in the
    process, so each such death was its own.  (A marker without the field, as replicas before it
    wrote, counts as a start beside others.)"""

    def __init__(self, parts_dir: Path) -> None:
        self.counts: dict[RowKey, int] = {}
        self.alone: dict[RowKey, int] = {}
        self._tail = _Tail(parts_dir, STARTED_GLOB)

    def refresh(self) -> None:
        for row in self._tail.new_rows():
            if isinstance(k := row.get("started"), (str, int)):
                self.counts[k] = self.counts.get(k, 0) + 1
                if row.get("alone") is True:
                    self.alone[k] = self.alone.get(k, 0) + 1
