"""Resuming a JSONL output file: which inputs already have a result line (caption and batch jobs),
and opening the file to append more.

A job appends one JSON object per finished input; a crash can leave a torn last line, which is
ignored (that input simply runs again) and ended before the next row is written, so that row is not
glued onto it.  One job at a time writes an output: it holds an exclusive lock on the file for its
whole run, as two jobs resuming the same file would each run nearly every input again."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import TextIO


class OutputFileError(ValueError):
    """The output file cannot take a job's rows: a directory, not creatable, or another job's."""


def open_output(out_path: Path) -> TextIO:
    """``out_path`` open to append rows, locked until it is closed: its parent directory created, a
    torn last line ended.  Raises ``OutputFileError`` (before any row is written)."""
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
    size = os.fstat(out.fileno()).st_size
    if size and os.pread(out.fileno(), 1, size - 1) != b"\n":
        out.write("\n")  # a torn last line: start ours on a fresh line
        out.flush()
    return out


def check_output(out_path: Path) -> None:
    """What ``open_output`` checks, done before a model loads (it creates the file when missing)."""
    open_output(out_path).close()


def done_keys(out_path: Path, key: str) -> set[str]:
    """The string values of ``key`` over every well-formed JSON object line of ``out_path`` (empty
    when the file does not exist)."""
    done: set[str] = set()
    if not out_path.exists():
        return done
    for line in out_path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get(key), str):
            done.add(rec[key])
    return done
