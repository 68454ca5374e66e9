"""The server's batches: an uploaded OpenAI batch file run through the live engine, beside the
interactive traffic, its results written back to the file store.

    POST /v1/batches ─► BatchRunner.create: the input file must be stored; the batch is queued
    one worker, batches in creation order:
      validating   the file read once on a thread: every line a JSON object with a custom_id (unique),
                   method POST, the batch's endpoint as url; at most MAX_BATCH_LINES lines. Any of
                   these wrong fails the batch (its errors name the lines), as OpenAI validates
      in_progress  ``concurrency`` lines in flight (--batch-concurrency), each answered by the same
                   ChatService as the route it names (lines.answer_line): a line whose body is bad,
                   or whose media fails, is an error line, the others go on
      finalizing   the answered lines as a file (purpose batch_output): 200s in output_file_id, the
                   rest in error_file_id, as OpenAI splits them
      completed | cancelled (POST /cancel: no new line starts, the ones in flight are aborted, what
                   was answered is kept) | expired (24 h after creation, OpenAI's window; answered
                   lines kept) | failed

Batch lines are engine requests like any other: the same admission (a full queue makes a line wait
for a slot, not fail), KV and caches; they keep the ``priority`` their bodies give, so under
``--queue-policy priority`` a batch written with a high number yields to interactive traffic.

Batches live in this process's memory (the files they read and write are the store's, on disk): a
restart forgets them. At most MAX_PENDING_BATCHES wait or run at once (more is a 429), and the
newest MAX_KEPT_BATCHES finished ones are kept for GET.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

from mm_pipeline.server.batches.lines import answer_line, failure_message, input_lines, parse_line
from mm_pipeline.server.batches.protocol import (WINDOW_S, BatchCreate, BatchError, BatchErrors, BatchList,
                                                 BatchObject)
from mm_pipeline.server.chat_service import ChatService
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.files.files_store import FileNotFoundInStore, FilesStore, UploadWriter

log = logging.getLogger(__name__)

MAX_BATCH_LINES = 50_000  # OpenAI's limit on one batch's requests
MAX_PENDING_BATCHES = 100
MAX_KEPT_BATCHES = 1000
MAX_ERRORS_SHOWN = 100  # validation errors a failed batch lists


def validate_file(path: Path, endpoint: str) -> tuple[int, list[BatchError]]:
    """(lines, errors) of a batch file: its structure only (a body is checked when its line runs)."""
    count, errors, seen = 0, [], set()

    def problem(n: int, code: str, message: str) -> None:
        if len(errors) < MAX_ERRORS_SHOWN:
            errors.append(BatchError(code=code, message=message, line=n))

    for n, raw, cid in input_lines(path):
        count += 1
        if count > MAX_BATCH_LINES:
            problem(n, "too_many_requests", f"the file has more than {MAX_BATCH_LINES:,} requests")
            break
        obj = _json_object(raw)
        if obj is None:
            problem(n, "invalid_json", f"line {n} is not a JSON object")
        elif cid is None:
            problem(n, "missing_custom_id", f"line {n} has no custom_id")
        elif cid in seen:
            problem(n, "duplicate_custom_id", f"line {n}: custom_id {cid!r} is used by an earlier line")
        elif str(obj.get("method", "POST")).upper() != "POST":
            problem(n, "invalid_method", f"line {n}: method {obj.get('method')!r} is not POST")
        elif obj.get("url") != endpoint:
            problem(n, "mismatched_url", f"line {n}: url {obj.get('url')!r} is not the batch's endpoint {endpoint}")
        if cid is not None:
            seen.add(cid)
    if count == 0:
        problem(0, "empty_file", "the file has no requests")
    return count, errors


def _json_object(raw: str | bytes) -> dict[str, Any] | None:
    if isinstance(raw, bytes):
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


class BatchRunner:
    """The batches of one server: created from the routes, run by one worker task on the event loop."""

    def __init__(self, service: ChatService, files: FilesStore, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {concurrency}")
        self.service = service
        self.files = files
        self.concurrency = concurrency
        self._batches: OrderedDict[str, BatchObject] = OrderedDict()
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._cancelled: set[str] = set()
        self._worker: asyncio.Task | None = None
        self._running: str | None = None  # the batch the worker runs now
        self._in_flight: set[asyncio.Task] = set()  # its lines being answered

    # ---- routes ----------------------------------------------------------------------------------
    def create(self, body: BatchCreate) -> BatchObject:
        try:
            self.files.get(body.input_file_id)
        except FileNotFoundInStore:
            raise APIError(404, f"no file with id {body.input_file_id!r}", param="input_file_id") from None
        if sum(not b.finished for b in self._batches.values()) >= MAX_PENDING_BATCHES:
            raise APIError(429, f"{MAX_PENDING_BATCHES} batches are waiting or running already; retry when one has "
                                f"finished", retry_after=60)
        batch = BatchObject(id=f"batch_{secrets.token_hex(12)}", endpoint=body.endpoint,
                            input_file_id=body.input_file_id, metadata=body.metadata)
        batch.expires_at = batch.created_at + WINDOW_S
        self._batches[batch.id] = batch
        self._forget_old()
        self._queue.put_nowait(batch.id)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work())
        return batch

    def get(self, batch_id: str) -> BatchObject:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id")
        return batch

    def list(self, limit: int, after: str | None) -> BatchList:
        newest_first = list(reversed(self._batches.values()))
        if after is not None:
            ids = [b.id for b in newest_first]
            newest_first = newest_first[ids.index(after) + 1:] if after in ids else []
        page = newest_first[:limit]
        return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                         has_more=len(newest_first) > limit)

    def cancel(self, batch_id: str) -> BatchObject:
        batch = self.get(batch_id)
        if batch.finished or batch.status == "cancelling":
            raise APIError(409, f"batch {batch_id} is {batch.status}: there is nothing to cancel", param="batch_id")
        self._cancelled.add(batch_id)
        batch.mark("cancelling")
        if self._running == batch_id:
            for task in self._in_flight:
                task.cancel()  # their engine requests are aborted (collect_all closes the choices)
        return batch

    async def close(self) -> None:
        """Stop the worker (the server is shutting down): the running batch fails, queued ones too."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for batch in self._batches.values():
            if not batch.finished:
                batch.errors = BatchErrors(data=[BatchError(code="server_shutdown",
                                                            message="the server shut down before the batch ended")])
                batch.mark("failed")

    # ---- the worker ------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            batch = self._batches.get(await self._queue.get())
            if batch is None or batch.finished:
                continue
            self._running = batch.id
            try:
                await self._run(batch)
            except Exception as exc:  # noqa: BLE001 -- a bug or a full store fails this batch, not the worker
                log.exception("batch %s failed", batch.id)
                batch.errors = BatchErrors(data=[BatchError(code="batch_failed", message=f"{type(exc).__name__}: {exc}")])
                batch.mark("failed")
            finally:
                self._running = None
                self._in_flight.clear()

    async def _run(self, batch: BatchObject) -> None:
        if self._stopped(batch):
            return self._end_unstarted(batch)
        path = self.files.path(batch.input_file_id)
        total, errors = await asyncio.to_thread(validate_file, path, batch.endpoint)
        if errors:
            batch.errors = BatchErrors(data=errors)
            return batch.mark("failed")
        if self._stopped(batch):
            return self._end_unstarted(batch)
        batch.request_counts.total = total
        batch.mark("in_progress")
        out = {"output": self.files.begin_upload(f"{batch.id}_output.jsonl", "batch_output"),
               "error": self.files.begin_upload(f"{batch.id}_error.jsonl", "batch_output")}
        try:
            await self._answer_lines(batch, iter(input_lines(path)), out)
            batch.mark("finalizing")
            ids = await asyncio.to_thread(_commit, out)
        except BaseException:
            for w in out.values():
                w.discard()
            raise
        batch.output_file_id, batch.error_file_id = ids["output"], ids["error"]
        if batch.id in self._cancelled:
            batch.mark("cancelled")
        elif time.time() >= (batch.expires_at or 0):
            batch.mark("expired")
        else:
            batch.mark("completed")

    async def _answer_lines(self, batch: BatchObject, lines: Iterator, out: dict[str, UploadWriter]) -> None:
        reading = asyncio.Lock()  # one reader of the file at a time (a generator is not shared safely)

        async def next_line() -> tuple[int, Any, Any] | None:
            async with reading:
                return await asyncio.to_thread(next, lines, None)

        async def one() -> None:
            while not self._stopped(batch):
                item = await next_line()
                if item is None:
                    return
                n, raw, _ = item
                task = asyncio.ensure_future(answer_line(self.service, parse_line(n, raw)))
                self._in_flight.add(task)
                try:
                    rec = await task
                except asyncio.CancelledError:
                    if self._stopped(batch):
                        return  # cancelled: the line is not answered
                    raise
                finally:
                    self._in_flight.discard(task)
                failed = failure_message(rec) is not None
                out["error" if failed else "output"].write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
                counts = batch.request_counts
                counts.failed += failed
                counts.completed += not failed

        async with asyncio.TaskGroup() as group:  # one failing (a full store) stops the others
            for _ in range(self.concurrency):
                group.create_task(one())

    def _stopped(self, batch: BatchObject) -> bool:
        return batch.id in self._cancelled or time.time() >= (batch.expires_at or 0)

    def _end_unstarted(self, batch: BatchObject) -> None:
        batch.mark("cancelled" if batch.id in self._cancelled else "expired")

    def _forget_old(self) -> None:
        finished = [b.id for b in self._batches.values() if b.finished]
        for batch_id in finished[:max(0, len(finished) - MAX_KEPT_BATCHES)]:
            del self._batches[batch_id]
            self._cancelled.discard(batch_id)


def _commit(out: dict[str, UploadWriter]) -> dict[str, str | None]:
    """The written files' ids (None for one nothing was written to: it is not kept)."""
    ids: dict[str, str | None] = {}
    for name, writer in out.items():
        if writer.nbytes:
            ids[name] = writer.commit().id
        else:
            writer.discard()
            ids[name] = None
    return ids
