"""Background responses (``background: true``): answered by a task the server owns, not by the
request that asked, so the client may hang up and poll.

    POST /v1/responses {"background": true}  ─► 200 at once: the response, queued, background: true
         a task answers it:  queued ─► in_progress ─► completed | incomplete | failed
                             (back to queued while the engine has no room: asked again, as batch lines are)
         POST /v1/responses/{id}/cancel, DELETE, server shutdown ─► cancelled (its engine requests aborted)
    GET /v1/responses/{id}                     ─► its state now, while it runs and after

Where an entry lives. While it runs: here, at most ``limit`` of them (--max-background-responses;
one more is a 429), not in the byte-bounded store. The store drops its least recently used entries
for room: a running one dropped there would either come back when it ended, its bytes uncounted
meanwhile, or vanish with its answer and nobody told. Held here it cannot be dropped, and the count
bounds what the running ones hold (each what a foreground request of the same body holds while it
is answered). Once it ends -- in any end state, so a poll finds ``failed`` and ``cancelled`` too --
its task puts it in the store like any other response (charged by its bytes, least recently used out
first from then on) and only then leaves this table: there is no moment it is in neither. Event loop
only.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from mm_pipeline.server.errors import APIError
from mm_pipeline.server.responses_api.events import record_failure
from mm_pipeline.server.responses_api.output import ResponseObject

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0  # told to a client over the limit: a background answer takes seconds, not milliseconds
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
        stores it. A 429 past the limit, a 503 once the server is shutting down."""
        if self._closed:
            raise APIError(503, "the server is shutting down: it starts no background response", retry_after=1)
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

    async def close(self) -> None:
        """Cancel every running response and wait for them (the server is shutting down)."""
        self._closed = True
        running = list(self._running.values())
        for r in running:
            self._stop(r)
        await asyncio.gather(*(r.done.wait() for r in running))

    # ---- internals ---------------------------------------------------------------------------
    @staticmethod
    def _stop(running: _Running) -> None:
        if running.response.status not in _RUNNING:
            return  # it ended and is being stored: nothing left to abort
        running.response.status = "cancelled"
        if running.started:
            # a task cancelled before its first step never runs a line of its coroutine (no
            # finally, nothing stored): one not started yet sees the status instead (_run)
            running.task.cancel()

    async def _run(self, running: _Running) -> None:
        response = running.response
        running.started = True
        try:
            if response.status != "cancelled":
                await running.answer()
        except asyncio.CancelledError:  # _stop: the engine streams are closed by the time it lands here
            asyncio.current_task().uncancel()
            response.status = "cancelled"
        except Exception as exc:  # noqa: BLE001 -- the response records it; nobody is left to answer it to
            record_failure(response, exc, f"/v1/responses (background {response.id})")
        try:
            await running.keep()
        except Exception:  # noqa: BLE001 -- a bug storing it: one traceback, and the task ends cleanly
            log.exception("background response %s could not be stored", response.id)
        finally:
            del self._running[response.id]
            running.done.set()
