"""Background responses (``background: true``): answered by a task the server owns, not by the
request that asked, so the client may hang up and poll.

    POST /v1/responses {"background": true}  ─► 200 at once: the response, queued, background: true
         a task answers it:  queued ─► in_progress ─► completed | incomplete | failed
                             (back to queued while the engine has no room: asked again, as batch lines are)
         POST /v1/responses/{id}/cancel, DELETE ─► cancelled (its engine requests aborted)
         server shutdown ─► failed, error server_error saying so (engine requests aborted likewise)
    GET /v1/responses/{id}                     ─► its state now, while it runs and after

Where an entry lives. While it runs: here, at most ``limit`` of them (--max-background-responses;
one more is a 429), not in the byte-bounded store. The store drops its least recently used entries
for room: a running one dropped there would either come back when it ended, its bytes uncounted
meanwhile, or vanish with its answer and nobody told. Held here it cannot be dropped, and the count
bounds what the running ones hold (each what a foreground request of the same body holds while it
is answered). Once it ends -- in any end state, so a poll finds ``failed`` and ``cancelled`` too --
its task puts it in the store like any other response (charged by its bytes, least recently used out
first from then on) and only then leaves this table: there is no moment it is in neither.

A server's shutdown (background_drain.py): from its drain's start ``start`` is a 503, the ones taken
run on through the grace period, and ``close`` ends those still queued or running then: ``failed``,
the error saying the server shut down (not ``cancelled``: nobody asked for it; a client polling
sees a failure it may send again). Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from mm_pipeline.errors import OverloadedError
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.responses_api.events import record_failure
from mm_pipeline.server.responses_api.output import ResponseObject

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0  # told to a client over the limit: a background answer takes seconds, not milliseconds
CLOSE_PATIENCE_S = 5.0  # close waits this long for the stopped ones to be stored (milliseconds, unless a bug)
SHUT_DOWN = "the server shut down before this response ended; send the request again"
_RUNNING = ("queued", "in_progress")


@dataclass
class _Running:
    response: ResponseObject  # filled by the task as it goes; what GET returns meanwhile
    input_items: list[dict[str, Any]]  # GET .../input_items while it runs
    answer: Callable[[], Awaitable[None]]  # fills ``response`` with the answer (response_of_chat)
    keep: Callable[[], Awaitable[None]]  # puts ``response`` in the store, whatever its end state
    task: asyncio.Task | None = None
    started: bool = False  # its task has begun: a cancel must now interrupt it (_stop)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class BackgroundResponses:
    """The background responses of one server that have not ended yet (module doc)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_background_responses must be >= 1, got {limit}")
        self.limit = limit
        self._running: dict[str, _Running] = {}
        self._closed = False

    def __len__(self) -> int:
        return len(self._running)

    def get(self, response_id: str) -> _Running | None:
        return self._running.get(response_id)

    def start(self, response: ResponseObject, input_items: list[dict[str, Any]],
              answer: Callable[[], Awaitable[None]], keep: Callable[[], Awaitable[None]]) -> None:
        """Answer ``response`` (queued) on a task of its own: ``answer`` fills it, then ``keep``
        stores it. A 429 past the limit, a 503 once the server is shutting down (as the engine refuses)."""
        if self._closed:
            raise APIError(503, "the server is shutting down: it starts no background response; retry on another "
                                "replica or later", retry_after=1, kind=OverloadedError.kind)
        if len(self._running) >= self.limit:
            raise APIError(429, f"{self.limit} background responses are queued or running already "
                                f"(--max-background-responses); retry when one has ended", param="background",
                           retry_after=RETRY_AFTER_S)
        running = _Running(response, input_items, answer, keep)
        running.task = asyncio.get_running_loop().create_task(self._run(running), name=f"background {response.id}")
        self._running[response.id] = running

    async def cancel(self, response_id: str) -> ResponseObject | None:
        """Cancel a queued or running response and wait until it is stored as ``cancelled`` (its
        engine requests aborted, their slots back); one already ending keeps its end state, waited
        for likewise. None when no background response of that id is running."""
        running = self._running.get(response_id)
        if running is None:
            return None
        self._stop(running)
        await running.done.wait()  # (a client hanging up on the cancel ends this wait, not the task)
        return running.response

    # ---- a server's shutdown (background_drain.py) --------------------------------------------
    def stop_taking(self) -> None:
        """From now on ``start`` is a 503; the ones running go on."""
        self._closed = True

    @property
    def busy(self) -> bool:
        return bool(self._running)

    async def close(self) -> None:
        """End every response still queued or running -- ``failed``, the error saying the server shut
        down; its engine requests aborted -- and wait until they are stored (CLOSE_PATIENCE_S at most)."""
        self._closed = True
        running = list(self._running.values())  # (one that has ended is being stored: waited for too)
        ending = [r for r in running if r.response.status in _RUNNING]
        for r in ending:
            self._stop(r, shutdown=True)
        if ending:
            log.warning("shutdown: %d background response(s) still queued or running ended (failed)", len(ending))
        if running:
            _, late = await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in running],
                                         timeout=CLOSE_PATIENCE_S)
            for waiter in late:
                waiter.cancel()
            if late:
                log.error("shutdown: %d background response(s) not stored %g s after they were ended", len(late),
                          CLOSE_PATIENCE_S)

    # ---- internals ---------------------------------------------------------------------------
    @staticmethod
    def _stop(running: _Running, shutdown: bool = False) -> None:
        """Record the end state (``cancelled``, or ``failed`` by a ``shutdown``) and interrupt the task."""
        if running.response.status not in _RUNNING:
            return  # it ended and is being stored: nothing left to abort
        if shutdown:
            running.response.fail("server_error", SHUT_DOWN)
        else:
            running.response.status = "cancelled"
        if running.started:
            # a task cancelled before its first step never runs a line of its coroutine (no
            # finally, nothing stored): one not started yet sees the status instead (_run)
            running.task.cancel()

    async def _run(self, running: _Running) -> None:
        response = running.response
        running.started = True
        try:
            if response.status in _RUNNING:  # not stopped before its first step
                await running.answer()
        except asyncio.CancelledError:  # _stop, which recorded the end state: the engine streams are closed now
            asyncio.current_task().uncancel()
            if response.status in _RUNNING:  # not _stop's: the event loop itself is ending (a second Ctrl-C)
                response.fail("server_error", SHUT_DOWN)
        except Exception as exc:  # noqa: BLE001 -- the response records it; nobody is left to answer it to
            if response.status in _RUNNING:  # else _stop's end state stands
                record_failure(response, exc, "/v1/responses (background)")
        try:
            await running.keep()
        except Exception:  # noqa: BLE001 -- a bug storing it: one traceback, and the task ends cleanly
            log.exception("background response %s could not be stored", response.id)
        finally:
            del self._running[response.id]
            running.done.set()
