"""``mmserve batch -i requests.jsonl -o results.jsonl``: OpenAI Batch files, run offline.

Input line (OpenAI Batch input format)::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...chat request...}}

Output line (OpenAI Batch output format)::

    {"id": "batch_req_…", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-…", "body": {...chat completion...}},
     "error": null}

A request the server would answer with an HTTP error (bad media, bad field) gets that status and the
OpenAI error body in ``response``; a line that is not a request at all (bad JSON, missing
custom_id, unsupported url) gets ``response: null`` and ``error: {code, message}``.  The ``model``
field of each body is ignored: the batch runs on the loaded model.  Lines already in the output
(by custom_id) are skipped, so an interrupted run resumes.  ``/v1/completions`` lines work too.
Lines are decoded one at a time: a line that is not UTF-8, or JSON nested too deeply to parse, is an
``invalid_json`` error line like any other broken line, and the rest of the file runs.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pydantic import ValidationError

from llm_core.engine.sampling import SamplingParams
from mm_pipeline.errors import InvalidInputError
from mm_pipeline.jobs.resume import done_keys, open_output
from mm_pipeline.jobs.progress import FAILURES_SHOWN, Progress
from mm_pipeline.jobs.replica_stats import ReplicaStats
from mm_pipeline.server.chat_service import ChatService, ServiceConfig
from mm_pipeline.prompt.reasoning import REASONING_PARSERS, resolve_reasoning
from mm_pipeline.prompt.tool_calls import TOOL_PARSERS, resolve_tool_calls
from mm_pipeline.server.errors import error_body, to_api_error
from mm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest

_URLS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


@dataclass
class BatchSummary:
    total: int = 0
    skipped: int = 0
    succeeded: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    failures: list[tuple[str | None, str]] = field(default_factory=list)  # the first FAILURES_SHOWN
    replicas: list[ReplicaStats] = field(default_factory=list)  # the Ray job's replicas (else empty)

    def add(self, custom_id: str | None, error: str | None) -> None:
        """Count one answered line (``error``: see ``failure_message``).  Only the failures the
        summary names are kept: a file of millions of failing lines must not keep them all."""
        if error is None:
            self.succeeded += 1
        else:
            self.failed += 1
            if len(self.failures) < FAILURES_SHOWN:
                self.failures.append((custom_id, error))

    def lines(self) -> list[str]:
        rate = (self.succeeded + self.failed) / self.elapsed_s if self.elapsed_s > 0 else 0.0
        out = [f"batch: {self.succeeded} succeeded, {self.failed} failed of {self.total - self.skipped} "
               f"requests in {self.elapsed_s:.2f} s ({rate:.2f} req/s)"
               + (f"; {self.skipped} already in the output were skipped" if self.skipped else "")]
        out += ReplicaStats.table(self.replicas)
        out += [f"  {cid}: {msg}" for cid, msg in self.failures]
        if self.failed > len(self.failures):
            out.append(f"  ... and {self.failed - len(self.failures)} more")
        return out


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
    model_cls = _URLS.get(obj.get("url"))
    if model_cls is None:
        return BatchLine(number, cid, None, (None, "invalid_url",
                                             f"url {obj.get('url')!r} is not one of {sorted(_URLS)}"))
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


@dataclass(frozen=True)
class BatchConfig:
    concurrency: int = 32  # lines in flight (the engine batches them)
    default_max_tokens: int = 512  # of a request without max_tokens
    # as `mmserve serve --reasoning-parser` (prompt/reasoning.py): a batch line's chat answer is the
    # one the server would give for it
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"  # as `mmserve serve --tool-call-parser` (prompt/tool_calls.py)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        try:  # the engine's rule, checked now: a bad default would fail every line without max_tokens
            SamplingParams(max_tokens=self.default_max_tokens)
        except ValueError as exc:
            raise ValueError(f"default_{exc}") from None  # "max_tokens must be ..." names the field
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; "
                             f"got {self.tool_call_parser!r}")


class BatchJob:
    """Runs an OpenAI batch file through a ``ChatService`` over the engine."""

    def __init__(self, engine: Any, concurrency: int = 32, default_max_tokens: int = 512,
                 reasoning_parser: str = "auto", tool_call_parser: str = "auto") -> None:
        config = BatchConfig(concurrency, default_max_tokens, reasoning_parser, tool_call_parser)
        reasoning = resolve_reasoning(config.reasoning_parser, getattr(engine, "tokenizer", None))
        tool_calls = resolve_tool_calls(config.tool_call_parser, getattr(engine, "tokenizer", None))
        self.service = ChatService(engine, ServiceConfig(getattr(engine, "model_name", "mmserve"),
                                                         config.default_max_tokens, reasoning=reasoning,
                                                         tool_calls=tool_calls))
        self.concurrency = config.concurrency

    async def run(self, in_path: str | Path, out_path: str | Path, progress_stream=None) -> BatchSummary:
        in_path, out_path = Path(in_path), Path(out_path)
        with open_output(out_path) as out:  # locked for the run: done lines are read under the lock
            done = done_keys(out_path, "custom_id")
            total = skipped = 0
            for line in input_lines(in_path):  # a cheap first pass for the progress total
                total += 1
                skipped += int(line[2] is not None and line[2] in done)
            summary = BatchSummary(total=total, skipped=skipped)
            progress = Progress(total - skipped, "batch", stream=progress_stream)
            # lines are parsed as workers take them: only `concurrency` request bodies live at once
            pending = (parse_line(n, raw) for n, raw, cid in input_lines(in_path) if cid is None or cid not in done)
            start = time.perf_counter()

            async def worker() -> None:
                for line in pending:
                    rec = await self.answer(line)
                    out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    out.flush()
                    error = failure_message(rec)
                    summary.add(line.custom_id, error)
                    progress.advance(1, failed=int(error is not None))

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        progress.close()
        summary.elapsed_s = time.perf_counter() - start
        return summary

    async def answer(self, line: BatchLine) -> dict[str, Any]:
        """The output line of one input line (both batch paths: one process, or a Ray replica)."""
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
                result = await self.service.chat(line.request)
            else:
                result = await self.service.complete(line.request)
            rec["response"] = {"status_code": 200, "request_id": result.id, "body": result.model_dump()}
        except Exception as exc:
            err = to_api_error(exc)
            rec["response"] = {"status_code": err.status, "request_id": None, "body": err.body()}
        return rec
