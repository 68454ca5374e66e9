"""A batch file's structure, checked before any of its lines runs (as OpenAI validates): every line
within the server's request limits (max_request_bytes, max_json_values: a line is a request), a
JSON object with a custom_id (unique), method POST and the batch's endpoint as url, and at most
MAX_BATCH_LINES lines. A body is checked when its line runs (a bad one is that line's error)."""

from __future__ import annotations

from pathlib import Path

from mm_pipeline.errors import echo
from mm_pipeline.server.batches.lines import header_problem, load_line, read_lines
from mm_pipeline.server.batches.protocol import BatchError
from mm_pipeline.server.json_limits import JSONLimits

MAX_BATCH_LINES = 50_000  # OpenAI's limit on one batch's requests
MAX_ERRORS_SHOWN = 100  # validation errors a failed batch lists


def validate_file(path: Path, endpoint: str, limits: JSONLimits) -> tuple[int, list[BatchError]]:
    """(lines, errors) of a batch file: its structure only. Reads the file once (on a thread)."""
    count, errors, seen = 0, [], set()

    def problem(n: int, code: str, message: str) -> None:
        if len(errors) < MAX_ERRORS_SHOWN:
            errors.append(BatchError(code=code, message=message, line=n))

    for n, raw in read_lines(path, limits.max_bytes):
        count += 1
        if count > MAX_BATCH_LINES:
            problem(n, "too_many_requests", f"the file has more than {MAX_BATCH_LINES:,} requests")
            break
        obj, trouble = load_line(n, raw, limits)  # the line's one parse here
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        if trouble is not None:
            problem(n, *trouble)
        elif not isinstance(obj, dict):
            problem(n, "invalid_json", f"line {n} is not a JSON object")
        elif (broken := header_problem(n, obj)) is not None:
            problem(n, *broken)
        elif cid in seen:
            problem(n, "duplicate_custom_id", f"line {n}: custom_id {echo(cid)} is used by an earlier line")
        elif obj.get("url") != endpoint:
            problem(n, "mismatched_url", f"line {n}: url {echo(obj.get('url'))} is not the batch's endpoint {endpoint}")
        if isinstance(cid, str) and cid:
            seen.add(cid)
    if count == 0:
        problem(0, "empty_file", "the file has no requests")
    return count, errors
