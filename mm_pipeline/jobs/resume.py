"""Resuming a JSONL output file: which inputs already have a result line (caption and batch jobs),
and opening the file to append more.

A job appends one JSON object per finished input; a crash can leave a torn last line, which is
ignored (that input simply runs again) and ended before the next row is written, so that row is not
glued onto it.  One job at a time writes an output: it holds an exclusive lock on the file for its
whole run, as two jobs resuming the same file would each run nearly every input again.  The ``--ray``
jobs take the same lock on their final file (``JobOutput.lock``).

Output files are read a line at a time (``iter_lines``), so resuming costs memory for the done keys,
not for the rows: lines are split on b"\n" only (a row written with ``ensure_ascii=False`` may hold
U+2028 or U+0085, which ``str.splitlines`` would cut it at), and a line over ``MAX_ROW_BYTES`` is
skipped unread (see there).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import BinaryIO, Iterator, TextIO, Union

# The longest line taken for one of our rows.  A caption row is a few KB (a path, a caption of
# --max-tokens tokens, an error message).  A batch row is a whole completion: about 1 KB per token
# with top-20 logprobs, so a few MB for a long answer, and only n=16 choices of ~64K-token answers
# with logprobs come near this cap.  A longer line is taken for a torn or foreign one and skipped
# (read through in chunks, never held): a reader of an output holds at most this much of one line.
MAX_ROW_BYTES = 1 << 30
_SKIP_CHUNK = 64 << 10  # how much of a skipped line is held at once


class OutputFileError(ValueError):
    """The output file cannot take a job's rows: a directory, not creatable, another job's, or in
    the other format (``check_format``)."""


PARQUET_MAGIC = b"PAR1"


def check_format(out_path: Path, fmt: str) -> None:
    """Raise ``OutputFileError`` when the existing ``out_path`` is not in ``fmt`` ("jsonl" or
    "parquet"): the one check for every job.  A JSONL job would read a Parquet file's rows as none
    and (``--ray``'s merge) replace them, or append lines to it; a Parquet merge would replace a
    JSONL file's rows.  An empty or missing file takes either."""
    try:
        with out_path.open("rb") as f:
            head = f.read(len(PARQUET_MAGIC))
    except (FileNotFoundError, IsADirectoryError):
        return  # open_output says what is wrong with a directory
    if not head:
        return
    if fmt == "parquet" and head != PARQUET_MAGIC:
        raise OutputFileError(f"{out_path} exists and is not a Parquet file; give another output "
                              f"(or leave --format parquet out to add JSONL rows to it)")
    if fmt != "parquet" and head == PARQUET_MAGIC:
        raise OutputFileError(f"{out_path} is a Parquet file; give --format parquet with --ray to add "
                              f"rows to it, or another output")


def open_output(out_path: Path, end_torn_line: bool = True) -> TextIO:
    """``out_path`` open to append rows, locked until it is closed: its parent directory created, a
    torn last line ended.  Raises ``OutputFileError`` (before any row is written), also for a Parquet
    file, which JSONL rows must not be appended to (``check_format``).  ``end_torn_line=False``: the file is only locked, never written through this handle (a ``--ray``
    job replaces it whole when it merges, and a Parquet file must not get a newline appended)."""
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # "a+": appends, and os.pread can look at the last byte; backslashreplace: a lone surrogate
        # (a file name that is not UTF-8, a "\ud800" escape in a batch line) becomes its JSON \u
        # escape, where strict UTF-8 would end the job at that row
        out = out_path.open("a+", encoding="utf-8", errors="backslashreplace")
    except OSError as exc:
        raise OutputFileError(f"cannot write {out_path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        out.close()
        raise OutputFileError(f"{out_path} is being written by another job (it holds the file's lock); "
                              f"let that one finish or write to another file") from None
    if end_torn_line:
        try:
            check_format(out_path, "jsonl")
        except OutputFileError:
            out.close()
            raise
    size = os.fstat(out.fileno()).st_size
    if end_torn_line and size and os.pread(out.fileno(), 1, size - 1) != b"\n":
        out.write("\n")  # a torn last line: start ours on a fresh line
        out.flush()
    return out


def row_bytes(row: dict) -> bytes:
    """One output line, as every writer writes a row (``open_output``'s file, a shard, the merge):
    raw UTF-8 (``ensure_ascii=False``), a lone surrogate (a file name that is not UTF-8) as its JSON
    ``\\u`` escape (backslashreplace), which ``parse_row`` reads back to the same string."""
    return json.dumps(row, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n"


def check_output(out_path: Path) -> None:
    """What ``open_output`` checks, done before a model loads (it creates the file when missing)."""
    open_output(out_path).close()


def iter_lines(f: BinaryIO, max_bytes: int = MAX_ROW_BYTES) -> Iterator[tuple[int, bytes | None]]:
    """(offset, line) for each line of the binary file ``f`` from its current position, split on
    b"\n" only (the newline kept).  ``line`` is None for a line longer than ``max_bytes``: it is read
    through in bounded chunks and never held whole.  The last line may lack its newline (torn)."""
    offset = f.tell()
    while True:
        line = f.readline(max_bytes + 1)  # readline(limit) holds at most limit bytes of a line
        if not line:
            return
        start, offset = offset, offset + len(line)
        if len(line) <= max_bytes or line.endswith(b"\n"):
            yield start, line
            continue
        del line  # over-long: skip to its end without keeping it
        while (chunk := f.readline(_SKIP_CHUNK)) and not chunk.endswith(b"\n"):
            offset += len(chunk)
        offset += len(chunk)
        yield start, None


def parse_row(line: bytes | None) -> dict | None:
    """The JSON object of one output line, or None for anything else (a torn, over-long, foreign or
    too deeply nested line).  Bytes that are not UTF-8 become U+FFFD: the row's other keys stay usable."""
    if line is None:
        return None
    try:
        row = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):  # JSONDecodeError; a hostile "[[[[..." line
        return None
    return row if isinstance(row, dict) else None


def iter_rows(path: Path, max_bytes: int = MAX_ROW_BYTES) -> Iterator[dict]:
    """The JSON object lines of the JSONL file ``path``, streamed (none when it does not exist)."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    with f:
        for _, line in iter_lines(f, max_bytes):
            if (row := parse_row(line)) is not None:
                yield row


RowKey = Union[str, int]  # an input's name (its ``key`` field), or the input line number of a keyless row


def row_key(row: dict, key: str) -> RowKey | None:
    """What names the input of an output row: its ``key`` field when a string, else, for a row whose
    ``key`` is null, the input line number its error names (``error.line``: a batch line without a
    custom_id, as OpenAI's batch errors name a line); None for a row that names no input.  The one
    rule for resume, shards and the merge, with and without ``--ray``."""
    k = row.get(key)
    if isinstance(k, str):
        return k
    error = row.get("error")
    if k is None and isinstance(error, dict) and type(error.get("line")) is int:
        return error["line"]
    return None


def done_keys(out_path: Path, key: str, max_bytes: int = MAX_ROW_BYTES) -> set[RowKey]:
    """The ``row_key`` of every well-formed JSON object line of ``out_path`` that has one (empty when
    the file does not exist).  Streamed: memory for the keys, not the file."""
    return {k for row in iter_rows(out_path, max_bytes) if (k := row_key(row, key)) is not None}
