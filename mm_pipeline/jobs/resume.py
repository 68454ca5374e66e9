"""Resuming a JSONL output file: which inputs already have a result line (caption and batch jobs).

A job appends one JSON object per finished input; a crash can leave a torn last line, which is
ignored (that input simply runs again)."""

from __future__ import annotations

import json
from pathlib import Path


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
