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
custom_id, unsupported url) gets ``response: null`` and ``error: {code, message, line}`` (``line``:
the input line's number, as OpenAI's batch errors name a line; a row without a custom_id is known
by it, so a resumed ``mmserve batch`` does not write it again). The ``model`` field of each body is
ignored: the batch runs on the loaded model. Lines are decoded one at a time:
a line that is not UTF-8, or JSON nested too deeply to parse, is an ``invalid_json`` error line like
any other broken line. The server holds each line to its request limits (``JSONLimits``: a line is a
request): a longer line is never read whole, one with too many JSON values is never parsed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from pydantic import ValidationError

from mm_pipeline.errors import InvalidInputError, OverloadedError, echo
from mm_pipeline.server.completions.chat_service import ChatService
from mm_pipeline.server.errors import error_body, to_api_error, validation_message
from mm_pipeline.server.json_limits import JSONLimits, too_many_bytes
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
    param: str | None = None  # the field a 400 problem names, as the route's answer names it


@dataclass(frozen=True)
class LineTooLong:
    """Stands for a line over ``max_bytes`` (``read_lines``): it was skipped, not read into memory."""

    max_bytes: int


def load_line(number: int, raw: str | bytes | LineTooLong, limits: JSONLimits | None = None
              ) -> tuple[Any, tuple[str, str] | None]:
    """(the line's JSON value, None) or (None, (code, message)) for a line that is over ``limits``,
    not UTF-8 or not JSON; never raises. The one parse of a line: validation and answering each
    call it once."""
    if isinstance(raw, LineTooLong):
        return None, ("line_too_large", too_many_bytes(raw.max_bytes, f"line {number}"))
    if limits is not None and (problem := limits.line_problem(raw, f"line {number}")) is not None:
        return None, problem
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text)
        # a \ud800-style escape without its pair is valid JSON but not Unicode: json.loads keeps it as a
        # lone surrogate, which no tokenizer and no UTF-8 output file takes (the HTTP parser refuses it)
        if ("\\ud" in text or "\\uD" in text) and not _encodable(value):  # a \\uDxxx escape: checked
            return None, ("invalid_json", f"line {number}: not valid Unicode (a \\uD800-\\uDFFF escape "
                                          f"without its pair)")
        return value, None
    except UnicodeDecodeError as exc:
        return None, ("invalid_json", f"line {number}: not UTF-8 ({exc.reason} at byte {exc.start})")
    except RecursionError:
        return None, ("invalid_json", f"line {number}: not JSON (nested too deeply)")
    except json.JSONDecodeError as exc:
        return None, ("invalid_json", f"line {number}: not JSON ({exc.msg})")
    except ValueError:  # an integer longer than int() takes (its message advises a Python setting)
        return None, ("invalid_json", f"line {number}: not JSON (a number with too many digits)")


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def header_problem(number: int, obj: dict[str, Any]) -> tuple[str, str] | None:
    """(code, message) when a line object breaks the rules every batch line obeys -- a custom_id,
    method POST -- else None: the one statement of them, for validation and answering alike."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "missing_custom_id", f"line {number} has no custom_id"
    if str(obj.get("method", "POST")).upper() != "POST":
        return "invalid_method", f"line {number}: method {echo(obj.get('method'))} is not POST"
    return None


def parse_line(number: int, raw: str | bytes | LineTooLong, limits: JSONLimits | None = None) -> BatchLine:
    """Validate one input line (``bytes``: a line that is not UTF-8, from ``input_lines``); never raises."""
    obj, problem = load_line(number, raw, limits)
    if problem is not None:
        return BatchLine(number, None, None, (None, *problem))
    if not isinstance(obj, dict):
        return BatchLine(number, None, None, (None, "invalid_request", f"line {number}: not a JSON object"))
    cid = _id_in(obj)
    if (problem := header_problem(number, obj)) is not None:
        return BatchLine(number, cid, None, (None, *problem))
    model_cls = URLS.get(obj.get("url"))
    if model_cls is None:
        return BatchLine(number, cid, None, (None, "invalid_url",
                                             f"url {echo(obj.get('url'))} is not one of {sorted(URLS)}"))
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(number, cid, None, (400, "invalid_request", "body must be a JSON object"))
    body = {**body, "model": None, "stream": False}
    try:
        return BatchLine(number, cid, model_cls.model_validate(body), None)
    except ValidationError as exc:  # named as the route names it (errors.validation_message)
        message, param = validation_message(exc.errors())
        return BatchLine(number, cid, None, (400, "invalid_request", message), param)


def decode_line(line: bytes) -> str | bytes | None:
    """One line of the input file as the jobs take it: text, or its bytes when it is not UTF-8
    (decoding the file whole would stop at it); None for a blank line, which is not a request.
    The one rule for both batch paths, so ``--ray``'s readers skip and number what this one does."""
    try:
        raw: str | bytes = line.decode("utf-8")
    except UnicodeDecodeError:
        raw = line
    return None if not raw or raw.isspace() else raw  # as ``raw.strip()``, without copying a long line


def input_lines(path: Path) -> Iterator[tuple[int, str | bytes, str | None]]:
    """(line number, raw line, custom_id if the line is JSON with one) for non-blank lines
    (``decode_line``), read a line at a time."""
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if (raw := decode_line(line)) is not None:
                yield n, raw, custom_id_of(raw)


def read_lines(path: Path, max_bytes: int) -> Iterator[tuple[int, str | bytes | LineTooLong]]:
    """(line number, raw line) for the non-blank lines (``decode_line``), numbered as ``input_lines``
    numbers them; a line over ``max_bytes`` (its newline not counted) is ``LineTooLong``, skipped a
    piece at a time instead of held whole."""
    with path.open("rb") as f:
        n = 0
        while line := f.readline(max_bytes + 2):  # + 2: room for the line's own \r\n
            n += 1
            if len(line) - _newline_bytes(line) > max_bytes:
                while not line.endswith(b"\n") and (line := f.readline(1 << 20)):
                    pass
                yield n, LineTooLong(max_bytes)
            elif (raw := decode_line(line)) is not None:
                yield n, raw


def _newline_bytes(line: bytes) -> int:
    return 2 if line.endswith(b"\r\n") else 1 if line.endswith(b"\n") else 0


def custom_id_of(raw: str | bytes | LineTooLong) -> str | None:
    """The custom_id ``parse_line`` gives the line's output row, or None where that row has none (a
    line ``load_line`` refuses -- not JSON, not UTF-8, a lone surrogate escape -- or no custom_id):
    the same check, so a job never expects a row under an id its answer drops."""
    obj, problem = load_line(0, raw)
    return None if problem is not None else _id_in(obj)  # parse_line makes the line's error row


def line_key(number: int, raw: str | bytes | LineTooLong) -> str | int:
    """What names input line ``number`` in the output, as its row names it (``jobs.resume.row_key``):
    its custom_id, else (no custom_id, or a line ``parse_line`` refuses) its line number, which the
    row's ``error.line`` carries.  Both batch paths skip done lines by it."""
    cid = custom_id_of(raw)
    return cid if cid is not None else number


def _id_in(obj: Any) -> str | None:
    """The custom_id of a loaded line (``parse_line`` and ``custom_id_of`` alike)."""
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The output line of a line that is not a request, or was never run: ``response`` null."""
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0  # a line the engine has no room for waits this long, doubling


class LineNotRun(Exception):
    """A line's wait for room in the engine ended because its batch stopped: it never ran (what the
    runner's ``before_retry`` raises)."""


def retry_overloaded(before_retry: Callable[[], None] = lambda: None) -> Callable[[OverloadedError], Awaitable[bool]]:
    """``answer_line``'s ``again`` for the lines of a batch, which nobody waits on interactively:
    when the engine had no room (its admission's 429, a saturated pool's 503), wait -- RETRY_FIRST_S
    doubling to RETRY_MAX_S -- and send the line again. ``before_retry`` runs after each wait and
    may raise to end the waiting (the server's batch was cancelled or expired). A request that can
    never fit (more choices than max_queue) is a 400 before admission, so this never spins on one."""
    delay = RETRY_FIRST_S

    async def again(_: OverloadedError) -> bool:
        nonlocal delay
        await asyncio.sleep(delay)
        delay = min(2 * delay, RETRY_MAX_S)
        before_retry()
        return True

    return again


async def answer_line(service: ChatService, line: BatchLine,
                      again: Callable[[OverloadedError], Awaitable[bool]] | None = None) -> dict[str, Any]:
    """The output line of one input line, answered by ``service`` as the server answers its route.
    ``again``: asked when the engine had no room for the line (``OverloadedError``); True sends it
    again (after the wait it chose), False answers the overload (429 / 503) as the route would."""
    rec: dict[str, Any] = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
                           "response": None, "error": None}
    if line.problem is not None:
        status, code, message = line.problem
        if status is None:
            rec["error"] = {"code": code, "message": message, "line": line.number}
        else:
            # a body that does not validate: what the server answers for it (an invalid input)
            rec["response"] = {"status_code": status, "request_id": None,
                               "body": error_body(status, message, param=line.param, kind=InvalidInputError.kind)}
        return rec
    while True:
        try:
            if isinstance(line.request, ChatCompletionRequest):
                result = await service.chat(line.request)
            else:
                result = await service.complete(line.request)
            rec["response"] = {"status_code": 200, "request_id": result.id, "body": result.model_dump()}
            return rec
        except OverloadedError as exc:
            if again is not None and await again(exc):
                continue
            err = to_api_error(exc)
        except Exception as exc:
            err = to_api_error(exc)
        rec["response"] = {"status_code": err.status, "request_id": None, "body": err.body()}
        return rec
