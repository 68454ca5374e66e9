"""A batch file's structure, checked before any of its lines runs (as OpenAI validates): every line
within the server's request limits (max_request_bytes, max_json_values: a line is a request), a
JSON object with a custom_id (unique), method POST and the batch's endpoint as url, and at most
MAX_BATCH_LINES lines. A body is checked when its line runs (a bad one is that line's error).
``mmserve batch`` refuses a file whose lines share a custom_id by the same rule (``CustomIds``)."""

from __future__ import annotations

from pathlib import Path

from mm_pipeline.errors import echo
from mm_pipeline.server.batches.lines import header_problem, input_lines, load_line, read_lines
from mm_pipeline.server.batches.protocol import BatchError
from mm_pipeline.server.json_limits import JSONLimits

MAX_BATCH_LINES = 50_000  # OpenAI's limit on one batch's requests
MAX_ERRORS_SHOWN = 100  # validation errors a failed batch lists


class CustomIds:
    """The custom_ids of a batch file's lines so far, each with the first line that has it: the rule
    that a custom_id names one line (an output row is found by it)."""

    def __init__(self) -> None:
        self.first: dict[str, int] = {}

    def duplicate(self, number: int, cid: object) -> str | None:
        """The message when line ``number``'s custom_id is an earlier line's, else None (and the id
        is noted). A missing, empty or non-string custom_id is no id: ``header_problem`` names it."""
        if not isinstance(cid, str) or not cid:
            return None
        first = self.first.setdefault(cid, number)
        if first == number:
            return None
        return f"line {number}: custom_id {echo(cid)} is used by an earlier line (line {first})"


def duplicate_custom_id(path: Path) -> str | None:
    """``CustomIds.duplicate``'s message for the first line of the batch file ``path`` that reuses a
    custom_id, else None; read a line at a time (``input_lines``, as ``mmserve batch`` reads it)."""
    ids = CustomIds()
    for n, _, cid in input_lines(path):
        if (dup := ids.duplicate(n, cid)) is not None:
            return dup
    return None


def validate_file(path: Path, endpoint: str, limits: JSONLimits) -> tuple[int, list[BatchError]]:
    """(lines, errors) of a batch file: its structure only. Reads the file once (on a thread)."""
    count, errors, ids = 0, [], CustomIds()

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
        dup = ids.duplicate(n, cid)  # noted for a line with another problem too
        if trouble is not None:
            problem(n, *trouble)
        elif not isinstance(obj, dict):
            problem(n, "invalid_json", f"line {n} is not a JSON object")
        elif (broken := header_problem(n, obj)) is not None:
            problem(n, *broken)
        elif dup is not None:
            problem(n, "duplicate_custom_id", dup)
        elif obj.get("url") != endpoint:
            problem(n, "mismatched_url", f"line {n}: url {echo(obj.get('url'))} is not the batch's endpoint {endpoint}")
    if count == 0:
        problem(0, "empty_file", "the file has no requests")
    return count, errors
