"""The server's batches: an uploaded OpenAI batch file run through the live engine, beside the
interactive traffic, its results written back to the file store.

    POST /v1/batches ─► BatchRunner.create: the input file must be stored, with purpose batch; the batch waits
    one worker, batches in creation order:
      validating   the file's structure, read once on a thread (validation.py): any line wrong
                   fails the batch (its errors name the lines), as OpenAI validates
      in_progress  ``concurrency`` lines in flight (--batch-concurrency), each read and parsed on a
                   thread and answered by the same ChatService as the route it names
                   (lines.answer_line): a line whose body is bad, or whose media fails, is an error
                   line, the others go on; a line the engine has no room for (its 429 / 503) waits
                   and is sent again (lines.retry_overloaded), while the batch runs
      finalizing   the answered lines as files (result_files.py, purpose batch_output): 200s in
                   output_file_id, the rest in error_file_id; a cancel is refused from here (409)
      completed | cancelled (POST /cancel: no new line starts, the ones in flight are aborted, what
                   was answered is kept; a batch still waiting ends at once, with no files) | expired
                   (24 h after creation, OpenAI's window: answered lines kept, each line not run an error
                   line ``batch_expired``, counted failed; a batch whose last line finished is completed)
                   | failed

A batch whose window closes before any of its lines ran -- while it waits, noticed by the worker or
when a client looks at it, or while it is validated -- expires the same way: ``finalizing`` at once
while its file is validated and each of its lines written ``batch_expired`` to its error file, on a
thread, then ``expired`` (request_counts: every line total and failed). An invalid file fails it
instead, naming the lines, as validation fails any batch: its lines are no requests to expire.

Batch lines are engine requests like any other: the same admission, KV and caches; they keep the
``priority`` their bodies give, so under ``--queue-policy priority`` a batch written with a high
number yields to interactive traffic.

A server's shutdown (background_drain.py): from its drain's start a create is a 503 and no waiting
batch starts, the running one goes on through the grace period, and ``close`` ends what is left
then: the running batch is cancelled as POST /cancel cancels it -- its lines in flight aborted, the
answered ones kept in its files (one finalizing finishes writing them) -- its ``errors`` naming
``server_shutdown``; the waiting ones are cancelled likewise, with no files (they never ran).

Batches live in this process's memory (the files they read and write are the store's, on disk, so a
shut-down batch's answered lines outlive it): a restart forgets them. At most MAX_PENDING_BATCHES
wait or run at once (more is a 429), and the newest MAX_KEPT_BATCHES finished ones are kept for GET.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Iterator

from mm_pipeline.errors import OverloadedError, echo
from mm_pipeline.server.batches.failure import fail_batch
from mm_pipeline.server.batches.lines import (BatchLine, LineNotRun, LineTooLong, answer_line, parse_line, read_lines,
                                              retry_overloaded)
from mm_pipeline.server.batches.result_files import ResultFiles
from mm_pipeline.server.batches.validation import validate_file
from mm_pipeline.server.batches.protocol import (WINDOW_S, BatchCreate, BatchError, BatchErrors, BatchList,
                                                 BatchObject)
from mm_pipeline.server.completions.chat_service import ChatService
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.files.files_store import FileNotFoundInStore, FilesStore
from mm_pipeline.server.json_limits import JSONLimits
from mm_pipeline.server.responses import cursor_page
from mm_pipeline.server.settings import ServerSettings

log = logging.getLogger(__name__)

MAX_PENDING_BATCHES = 100
MAX_KEPT_BATCHES = 1000
CLOSE_PATIENCE_S = 5.0  # close waits this long for the running batch to stop and write its files

RawLines = Iterator[tuple[int, str | bytes | LineTooLong]]


class BatchRunner:
    """The batches of one server: created from the routes, run by one worker task on the event loop.

    A batch waits (``validating``, not yet the one running) in ``_batches``, which is in creation
    order: the worker takes the oldest waiting one, so a cancelled or expired one is simply not
    taken -- nothing else holds it but, while its error file is written, an expired one's task in
    ``_expiring``."""

    def __init__(self, service: ChatService, files: FilesStore, concurrency: int,
                 limits: JSONLimits = ServerSettings().json_limits) -> None:
        if concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {concurrency}")
        self.service = service
        self.files = files
        self.concurrency = concurrency
        self.limits = limits  # each line is held to a request's limits
        self._batches: OrderedDict[str, BatchObject] = OrderedDict()
        self._cancelled: set[str] = set()
        self._worker: asyncio.Task | None = None
        self._running: str | None = None  # the batch the worker runs now
        self._in_flight: set[asyncio.Task] = set()  # its lines being answered
        self._expiring: dict[str, asyncio.Task] = {}  # batches expired waiting: their error files being written
        # one written at a time: a burst of batches expiring together reads their files on one thread,
        # not on every thread of the loop's executor, which the running batch reads its lines with
        self._expiry_turn = asyncio.Lock()
        self._closing = False  # the server is shutting down: no batch is created or started

    # ---- routes ----------------------------------------------------------------------------------
    def create(self, body: BatchCreate) -> BatchObject:
        if self._closing:
            raise APIError(503, "the server is shutting down: it starts no batch; retry on another replica or later",
                           retry_after=1, kind=OverloadedError.kind)
        try:
            rec = self.files.get(body.input_file_id)
        except FileNotFoundInStore:
            raise APIError(404, f"no file with id {echo(body.input_file_id)}", param="input_file_id") from None
        if rec.purpose != "batch":
            raise APIError(400, f"file {echo(body.input_file_id)} has purpose {rec.purpose!r}: a batch's input file is "
                                f"uploaded with purpose 'batch'", param="input_file_id")
        self._settle_waiting()
        if sum(not b.finished for b in self._batches.values()) >= MAX_PENDING_BATCHES:
            raise APIError(429, f"{MAX_PENDING_BATCHES} batches are waiting or running already; retry when one has "
                                f"finished", retry_after=60)
        batch = BatchObject(id=f"batch_{secrets.token_hex(12)}", endpoint=body.endpoint,
                            input_file_id=body.input_file_id, metadata=body.metadata)
        batch.expires_at = batch.created_at + WINDOW_S
        self._batches[batch.id] = batch
        self._forget_old()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work())
        return batch

    def reading(self, file_id: str) -> str | None:
        """The id of a batch not yet ended (a waiting one past its window is ended first) whose
        input is ``file_id``, which the files route then refuses to delete; else None."""
        self._settle_waiting()
        return next((b.id for b in self._batches.values() if b.input_file_id == file_id and not b.finished), None)

    def get(self, batch_id: str) -> BatchObject:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise APIError(404, f"no batch with id {echo(batch_id)}", param="batch_id")
        self._settle(batch)
        return batch

    def list(self, limit: int, after: str | None) -> BatchList:
        self._settle_waiting()
        return BatchList(**cursor_page(list(reversed(self._batches.values())), lambda b: b.id, limit, after))

    def cancel(self, batch_id: str) -> BatchObject:
        """Stop a batch. One still waiting is ``cancelled`` at once; a running one is ``cancelling``
        until its lines in flight are aborted. Refused (409) once it is ``finalizing``: its lines
        are all answered or expired and its files are being written, so a cancel could only mislabel
        them."""
        batch = self.get(batch_id)
        if batch.finished or batch.status == "cancelling":
            raise APIError(409, f"batch {batch_id} is {batch.status}: there is nothing to cancel", param="batch_id")
        if batch.status == "finalizing":
            raise APIError(409, f"batch {batch_id} is finalizing: its lines are all answered or expired and its files "
                                f"are being written", param="batch_id")
        self._stop(batch)
        return batch

    # ---- a server's shutdown (background_drain.py) -----------------------------------------------
    def stop_taking(self) -> None:
        """From now on a create is a 503 and the worker starts no waiting batch; the running one goes on."""
        self._closing = True

    @property
    def busy(self) -> bool:
        """A batch runs, or an expired one's error file is being written."""
        return (self._worker is not None and not self._worker.done()) or bool(self._expiring)

    async def close(self) -> None:
        """End every batch (module doc): the running one cancelled, its answered lines kept, and
        waited for (CLOSE_PATIENCE_S at most: past that its worker is cancelled, and it fails); the
        waiting ones cancelled; the expiries being written stopped, failing their batches."""
        self._closing = True
        shut_down = BatchErrors(data=[BatchError(code="server_shutdown",
                                                 message="the server shut down before the batch ended")])
        ending = [b for b in self._batches.values() if not b.finished and b.status not in ("cancelling", "finalizing")]
        for batch in ending:
            batch.errors = shut_down
            self._stop(batch)
        if ending:
            log.warning("shutdown: %d batch(es) still waiting or running cancelled", len(ending))
        if self._worker is not None:
            await asyncio.wait([self._worker], timeout=CLOSE_PATIENCE_S)
            self._worker.cancel()  # (a no-op once it ended)
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        expiring = list(self._expiring.values())
        for task in expiring:
            task.cancel()
        await asyncio.gather(*expiring, return_exceptions=True)
        for batch in self._batches.values():
            if not batch.finished:  # its worker or expiry was cancelled: its files are not written
                batch.errors = shut_down
                batch.mark("failed")

    # ---- the worker ------------------------------------------------------------------------------
    async def _work(self) -> None:
        while (batch := self._next_waiting()) is not None:
            self._running = batch.id
            try:
                await self._run(batch)
            except Exception as exc:  # noqa: BLE001 -- a bug or a full store fails this batch, not the worker
                fail_batch(batch, exc)
            finally:
                self._running = None
                self._in_flight.clear()

    async def _run(self, batch: BatchObject) -> None:
        if self._stopped(batch):
            return await self._end_unstarted(batch)
        total = await self._validated(batch)
        if total is None:
            return None
        path = self.files.path(batch.input_file_id)
        if self._stopped(batch):
            return await self._end_unstarted(batch, total)
        batch.request_counts.total = total
        batch.mark("in_progress")
        out = ResultFiles(self.files, batch)
        try:
            # not closed here: a reader thread a failing TaskGroup left behind may still be in it
            lines = read_lines(path, self.limits.max_bytes)
            expired = await self._answer_lines(batch, lines, out)
            if batch.id not in self._cancelled:  # the lines never read because the batch expired
                expired += await asyncio.to_thread(out.expire_rest, lines)
            if batch.status != "cancelling":
                batch.mark("finalizing")
            ids = await asyncio.to_thread(out.commit)
        except BaseException:
            out.discard()
            raise
        batch.output_file_id, batch.error_file_id = ids["output"], ids["error"]
        if batch.id in self._cancelled:
            batch.mark("cancelled")
        elif expired:
            batch.mark("expired")
        else:  # every line answered, even if the last just after expires_at
            batch.mark("completed")

    async def _validated(self, batch: BatchObject) -> int | None:
        """The number of lines of the batch's input file, checked on a thread; None when the file is
        invalid: the batch is then ``failed``, naming its lines."""
        path = self.files.path(batch.input_file_id)
        total, errors = await asyncio.to_thread(validate_file, path, batch.endpoint, self.limits)
        if errors:
            batch.errors = BatchErrors(data=errors)
            batch.mark("failed")
            return None
        return total

    async def _answer_lines(self, batch: BatchObject, lines: RawLines, out: ResultFiles) -> int:
        """Answer lines until the file ends or the batch stops; the number of lines read but not
        run because it expired (each written as a ``batch_expired`` error line)."""
        reading = asyncio.Lock()  # one reader of the file at a time (a generator is not shared safely)
        expired = 0

        def next_line() -> BatchLine | None:
            item = next(lines, None)
            return None if item is None else parse_line(*item, self.limits)

        async def one() -> None:
            nonlocal expired
            while not self._stopped(batch):
                async with reading:
                    # read and parsed on a thread: a line may be as long as a request body
                    line = await asyncio.to_thread(next_line)
                if line is None:
                    return
                try:
                    rec = await self._answer(batch, line)
                except LineNotRun:
                    if batch.id in self._cancelled:
                        return
                    out.expired(line.custom_id)
                    expired += 1
                    continue
                if rec is None:
                    return  # cancelled: the line is not answered
                out.write(rec)

        async with asyncio.TaskGroup() as group:  # one failing (a full store) stops the others
            for _ in range(self.concurrency):
                group.create_task(one())
        return expired

    async def _answer(self, batch: BatchObject, line: BatchLine) -> dict[str, Any] | None:
        """The output line of ``line``; None when a cancel aborted it in flight. ``LineNotRun`` when the
        batch stopped before the line ran: while it was read (checked again here, after the read), or
        while it waited for room in the engine."""
        if self._stopped(batch):
            raise LineNotRun
        task = asyncio.ensure_future(answer_line(self.service, line, self._patience(batch)))
        self._in_flight.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if self._stopped(batch):
                return None
            raise
        finally:
            self._in_flight.discard(task)

    def _patience(self, batch: BatchObject) -> Callable[[OverloadedError], Awaitable[bool]]:
        """``answer_line``'s ``again`` for one line: lines.retry_overloaded, for as long as the batch
        runs. A stop ends the wait: the line never ran (``LineNotRun``)."""
        def still_running() -> None:
            if self._stopped(batch):
                raise LineNotRun

        return retry_overloaded(still_running)

    def _stop(self, batch: BatchObject) -> None:
        """Cancel a waiting or running batch: a waiting one is ``cancelled`` at once; the running one is
        ``cancelling`` while the lines in flight are aborted, then ``cancelled`` with the answered lines'
        files (``_run``)."""
        waiting = self._waiting(batch)
        self._cancelled.add(batch.id)
        batch.mark("cancelling")
        if waiting:
            batch.mark("cancelled")  # never started: nothing to stop, and it no longer counts as pending
        elif self._running == batch.id:
            for task in self._in_flight:
                task.cancel()  # their engine requests are aborted (collect_all closes the choices)

    def _stopped(self, batch: BatchObject) -> bool:
        return batch.id in self._cancelled or time.time() >= (batch.expires_at or 0)

    async def _end_unstarted(self, batch: BatchObject, total: int | None = None) -> None:
        """The worker's batch stopped before any of its lines ran: ``cancelled`` (no files, as OpenAI
        gives none), or expired (``_expire_unstarted``; ``total``: its lines, when it was validated)."""
        if batch.id in self._cancelled:
            return batch.mark("cancelled")
        batch.mark("finalizing")
        await self._expire_unstarted(batch, total)

    async def _expire_unstarted(self, batch: BatchObject, total: int | None = None) -> None:
        """End a ``finalizing`` batch whose window closed before any of its lines ran, as one that
        expires mid-run ends: ``expired``, each line a ``batch_expired`` error line in its error file,
        request_counts total and failed its lines. Its file is validated first unless ``total`` says
        it was: an invalid one fails the batch naming its lines, as validation does, and has no error
        file. The file is read a line at a time, on threads."""
        if total is None and (total := await self._validated(batch)) is None:
            return None
        path = self.files.path(batch.input_file_id)
        batch.request_counts.total = total
        out = ResultFiles(self.files, batch)
        try:
            await asyncio.to_thread(out.expire_rest, read_lines(path, self.limits.max_bytes))
            ids = await asyncio.to_thread(out.commit)
        except BaseException:
            out.discard()
            raise
        batch.output_file_id, batch.error_file_id = ids["output"], ids["error"]
        batch.mark("expired")

    async def _expire_waiting(self, batch: BatchObject) -> None:
        """``_expire_unstarted`` for a batch ``_settle`` found expired, off the worker; one at a time."""
        try:
            async with self._expiry_turn:
                await self._expire_unstarted(batch)
        except Exception as exc:  # noqa: BLE001 -- a full store fails this batch, as it would in the worker
            fail_batch(batch, exc)
        finally:
            self._expiring.pop(batch.id, None)

    def _waiting(self, batch: BatchObject) -> bool:
        """Created, not yet taken by the worker."""
        return batch.status == "validating" and batch.id != self._running

    def _settle(self, batch: BatchObject) -> None:
        """A waiting batch past its window ends when looked at, not when the worker reaches it (which
        may run another batch for hours): ``finalizing`` now, so it no longer waits and a cancel is
        refused, then ``expired`` once a task has written its error file (``_expire_waiting``: on
        the event loop, the file is read on a thread)."""
        if self._waiting(batch) and time.time() >= (batch.expires_at or 0):
            batch.mark("finalizing")
            self._expiring[batch.id] = asyncio.get_running_loop().create_task(self._expire_waiting(batch))

    def _settle_waiting(self) -> None:
        for batch in self._batches.values():
            self._settle(batch)

    def _next_waiting(self) -> BatchObject | None:
        if self._closing:
            return None
        self._settle_waiting()
        return next((b for b in self._batches.values() if self._waiting(b)), None)

    def _forget_old(self) -> None:
        finished = [b.id for b in self._batches.values() if b.finished]
        for batch_id in finished[:max(0, len(finished) - MAX_KEPT_BATCHES)]:
            del self._batches[batch_id]
            self._cancelled.discard(batch_id)

