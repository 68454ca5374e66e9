"""OpenAI's Responses API: ``POST /v1/responses`` (what ``client.responses.create`` sends), streamed or
not, ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and ``DELETE
/v1/responses/{id}`` for stored responses.

A request becomes a chat (protocol.py: input items -> messages, instructions -> a system message
first, the previous response's conversation before them) and is answered by the same ChatService as
/v1/chat/completions: the same admission, limits, media pipeline, encoder and prefix caches,
reasoning and tool-call parsers, errors and disconnect handling. The answer is reshaped into output
items (output.py; streamed: events.py). With ``store`` (the default) the response and its
conversation are kept for ``previous_response_id`` and GET (store.py). Not served: background mode,
``/cancel`` (nothing runs after its request closes), the Conversations API.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from mm_pipeline.server.answer_info import AnswerInfo
from mm_pipeline.server.chat_service import ChatService
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.protocol import ChatCompletionRequest
from mm_pipeline.server.responses_api.events import ResponseEvents
from mm_pipeline.server.responses_api.output import ResponseObject, response_of_chat
from mm_pipeline.server.responses_api.protocol import (FunctionCallOutputItem, MessageItem, ResponsesRequest, chat_body,
                                                       listed_items)
from mm_pipeline.server.responses_api.store import ResponseStore, entry_bytes
from mm_pipeline.server.sse import SSE_HEADERS, ClientDisconnected, until_disconnected

log = logging.getLogger(__name__)
BodyReader = Callable[[Request, type[BaseModel]], Awaitable[Any]]
# Past this many messages and input items, the chat a request becomes is built and validated on a
# thread (~7 us a message: a follow-up of a 200 K-message conversation held the loop for 1.4 s), and
# the entry to store sized there too. A stored entry of more values than _INLINE_VALUES is sized on
# a thread as well (~0.4 us a value: many logprobs, big tool schemas); counting stops there.
_INLINE_ITEMS = 256
_INLINE_VALUES = 1024


def install_responses_routes(app: FastAPI, service: ChatService, store: ResponseStore, read_body: BodyReader) -> None:
    """Add the routes; ``service`` answers the chat each request becomes, ``store`` keeps responses,
    ``read_body`` reads a JSON body under the server's size limits (app.parse_body)."""

    def stored(response_id: str):
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response with id {response_id!r}", param="response_id",
                           code="response_not_found")
        return entry

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await read_body(request, ResponsesRequest)
        service.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = store.get(req.previous_response_id)
            if previous is None:
                raise APIError(400, f"previous response {req.previous_response_id!r} is not stored here (never "
                               f"stored, deleted, or dropped for room: --responses-store-bytes); send the "
                               f"conversation as input instead", param="previous_response_id",
                               code="previous_response_not_found")
            history = previous.history
        # the chat holds the history too: a one-item follow-up of a long conversation is long
        long = len(history) + (len(req.input) if isinstance(req.input, list) else 1) > _INLINE_ITEMS
        chat, turn = await asyncio.to_thread(_chat_request, req, history) if long else _chat_request(req, history)
        response = ResponseObject.of_request(req, service.config.model_name, store=req.store and store.enabled,
                                             defaults=service.defaults)
        conversation = history + turn

        async def keep() -> None:
            if not response.store or response.status not in ("completed", "incomplete"):
                return
            kept = conversation + [response.answer_message()]
            entry = None if long else _sized_entry(response, kept, req.input, _INLINE_VALUES)
            items, size = entry or await asyncio.to_thread(_sized_entry, response, kept, req.input)
            if not store.fits(size):
                log.info("response %s not stored: it is larger than --responses-store-bytes (%d)",
                         response.id, store.max_bytes)
                return
            store.put(response, kept, size, items)

        info = AnswerInfo()
        try:
            if not req.stream:
                answer = await until_disconnected(request, service.chat(chat, info))
                response_of_chat(response, answer)
                await keep()
                info.request_id = response.id
                return JSONResponse(response.model_dump(), headers=info.headers())
            chunks, close = await until_disconnected(request, service.chat_chunks(chat, info))
        except ClientDisconnected:
            return Response(status_code=499)
        info.request_id = response.id

        async def events() -> AsyncIterator[str]:
            async for event in ResponseEvents(response).events(chunks):
                yield event
            await keep()

        return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **info.headers()},
                                 background=BackgroundTask(close))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored(response_id).response.model_dump())

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: int = Query(default=20, ge=1, le=100), after: str | None = None,
                               order: Literal["asc", "desc"] = "desc") -> JSONResponse:
        items = stored(response_id).input_items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        stored(response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                                 list[dict[str, Any]]]:
    """The chat ``req`` is answered as (a 400 naming what cannot be, by its Responses name), and its
    input as messages."""
    origins: list[int] = []
    try:
        body, turn = chat_body(req, history, origins)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    try:
        return ChatCompletionRequest.model_validate(body), turn
    except ValidationError as exc:
        first = (1 if req.instructions else 0) + len(history)  # the input's messages come after these
        errors = [{**e, "loc": _input_loc(e["loc"], first, origins, req.input)} for e in exc.errors()]
        raise RequestValidationError(errors) from None


def _input_loc(loc: tuple[Any, ...], first: int, origins: list[int], items: str | list[Any]) -> tuple[Any, ...]:
    """A chat error's location as the request spells it: ``messages.k.content.p`` (k counted from the
    instructions and the history) is ``input.i.content.p``, i the item message k came from (the
    part's own fields are the chat's spelling, so the part is named); other fields as they are."""
    if len(loc) < 2 or loc[0] != "messages" or not isinstance(loc[1], int) or not 0 <= loc[1] - first < len(origins):
        return loc  # the instructions and the history are valid: they were answered before
    if isinstance(items, str):
        return ("input",)
    i = origins[loc[1] - first]
    field = {MessageItem: "content", FunctionCallOutputItem: "output"}.get(type(items[i]))
    if field is None or loc[2:3] != ("content",):
        return ("input", i)
    part = next((p for p in loc[3:] if isinstance(p, int)), None)
    return ("input", i, field) if part is None else ("input", i, field, part)


def _sized_entry(response: ResponseObject, kept: list[dict[str, Any]], given: str | list[Any],
                       max_values: int | None = None) -> tuple[list[dict[str, Any]], int] | None:
    """The input items and the size (store.entry_bytes) of the entry that keeps ``response``; None
    when it holds more than ``max_values`` values."""
    items = listed_items(given)
    size = entry_bytes(response, kept, items, max_values)
    return None if size is None else (items, size)
