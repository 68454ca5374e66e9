"""Server-sent events and client-disconnect handling.

A streamed answer is ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``.  An error after
the first event can no longer change the HTTP status, so it travels as one ``data: {"error": ...}``
event before ``[DONE]`` (what OpenAI and vLLM do).

Disconnects: Starlette's ``StreamingResponse`` cancels the body iterator when the client goes away
(our iterators close their engine streams in ``finally``, which aborts the requests).  Before the
response starts — non-streamed requests, or a streamed one waiting for its first token —
``until_disconnected`` watches the ASGI receive channel and cancels the work itself.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from mm_pipeline.server.errors import log_rejection, to_api_error

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
# no caching, and no buffering in a proxy (nginx reads X-Accel-Buffering): each event goes out as made
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One SSE ``data:`` event holding ``payload`` as compact JSON."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_unset=False)
    else:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n"


def error_event(exc: Exception, route: str | None = None, request_id: str | None = None) -> str:
    """A failure after the stream started can no longer change the HTTP status: it travels as one
    event with the body the status would have had (its kind included). Its log line is the other
    error lines' (errors.log_rejection), naming the request's id (the stream's ``X-Request-Id``) and
    ``route``, which says the stream had started: ``chatcmpl-7f3a: POST '/v1/chat/completions
    (stream already started)' -> 503 ...``."""
    err = to_api_error(exc)
    log_rejection(err, "POST", f"{route} (stream already started)" if route else "(stream already started)",
                  request_id)
    return sse_event(err.body())


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message on the channel is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``.

    Cancelling ``work`` runs its ``finally`` blocks, which close the engine streams (abort)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientDisconnected("client disconnected")
