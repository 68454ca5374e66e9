"""The OpenAI Batch file format, one line at a time: what ``mmserve batch`` (mm_pipeline/jobs/batch.py,
one process or Ray replicas) and the server's ``/v1/batches`` (runner.py) both read and write.

Input line::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...chat request...}}

Output line::

    {"id": "batch_req_…", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-…", "body": {...chat completion...}},
     "error": null}

A request the server would answer with an HTTP error (bad media, bad field) gets that status and the
OpenAI error body in ``response``; a line that is not a request at all (bad JSON, missing
custom_id, unsupported url) gets ``response: null`` and ``error: {code, message}``. The ``model``
field of each body is ignored: the batch runs on the loaded model. Lines are decoded one at a time:
a line that is not UTF-8, or JSON nested too deeply to parse, is an ``invalid_json`` error line like
any other broken line.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pydantic import ValidationError

from mm_pipeline.errors import InvalidInputError
from mm_pipeline.server.chat_service import ChatService
from mm_pipeline.server.errors import error_body, to_api_error
from mm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest

URLS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def failure_message(rec: dict[str, Any]) -> str | None:
    """None for an answered request (status 200), else the message of its error."""
    if rec["error"] is None and rec["response"]["status_code"] == 200:
        return None
    return rec["error"]["message"] if rec["error"] else rec["response"]["body"]["error"]["message"]


@dataclass(frozen=True)
class BatchLine:
    number: int
    custom_id: str | None
    request: ChatCompletionRequest | CompletionRequest | None
    problem: tuple[int | None, str, str] | None  # (HTTP status or None, code, message)


def parse_line(number: int, raw: str | bytes) -> BatchLine:
    """Validate one input line (``bytes``: a line that is not UTF-8, from ``input_lines``); never raises."""
    try:
        obj = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError as exc:
        return BatchLine(number, None, None, (None, "invalid_json",
                                              f"line {number}: not UTF-8 ({exc.reason} at byte {exc.start})"))
    except RecursionError:
        return BatchLine(number, None, None, (None, "invalid_json", f"line {number}: not JSON (nested too deeply)"))
    except ValueError as exc:  # JSONDecodeError, or an integer longer than int() takes
        return BatchLine(number, None, None, (None, "invalid_json",
                                              f"line {number}: not JSON ({getattr(exc, 'msg', exc)})"))
    if not isinstance(obj, dict):
        return BatchLine(number, None, None, (None, "invalid_request", f"line {number}: not a JSON object"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(number, None, None, (None, "missing_custom_id", f"line {number}: no custom_id"))
    if str(obj.get("method", "POST")).upper() != "POST":
        return BatchLine(number, cid, None, (None, "invalid_method", f"method {obj.get('method')!r} is not POST"))
    model_cls = URLS.get(obj.get("url"))
    if model_cls is None:
        return BatchLine(number, cid, None, (None, "invalid_url",
                                             f"url {obj.get('url')!r} is not one of {sorted(URLS)}"))
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(number, cid, None, (400, "invalid_request", "body must be a JSON object"))
    body = {**body, "model": None, "stream": False}
    try:
        return BatchLine(number, cid, model_cls.model_validate(body), None)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return BatchLine(number, cid, None, (400, "invalid_request", f"{where}: {first.get('msg')}" if where
                                             else str(first.get("msg"))))


def decode_line(line: bytes) -> str | bytes | None:
    """One line of the input file as the jobs take it: text, or its bytes when it is not UTF-8
    (decoding the file whole would stop at it); None for a blank line, which is not a request.
    The one rule for both batch paths, so ``--ray``'s readers skip and number what this one does."""
    try:
        raw: str | bytes = line.decode("utf-8")
    except UnicodeDecodeError:
        raw = line
    return raw if raw.strip() else None


def input_lines(path: Path) -> Iterator[tuple[int, str | bytes, str | None]]:
    """(line number, raw line, custom_id if the line is JSON with one) for non-blank lines
    (``decode_line``), read a line at a time."""
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if (raw := decode_line(line)) is not None:
                yield n, raw, custom_id_of(raw)


def custom_id_of(raw: str | bytes) -> str | None:
    if isinstance(raw, bytes):
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # parse_line makes the line's error row
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


async def answer_line(service: ChatService, line: BatchLine) -> dict[str, Any]:
    """The output line of one input line, answered by ``service`` as the server answers its route."""
    rec: dict[str, Any] = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
                           "response": None, "error": None}
    if line.problem is not None:
        status, code, message = line.problem
        if status is None:
            rec["error"] = {"code": code, "message": message}
        else:
            # a body that does not validate: what the server answers for it (an invalid input)
            rec["response"] = {"status_code": status, "request_id": None,
                               "body": error_body(status, message, kind=InvalidInputError.kind)}
        return rec
    try:
        if isinstance(line.request, ChatCompletionRequest):
            result = await service.chat(line.request)
        else:
            result = await service.complete(line.request)
        rec["response"] = {"status_code": 200, "request_id": result.id, "body": result.model_dump()}
    except Exception as exc:
        err = to_api_error(exc)
        rec["response"] = {"status_code": err.status, "request_id": None, "body": err.body()}
    return rec
