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
from mm_pipeline.server.responses_api.protocol import ResponsesRequest, chat_body, listed_items
from mm_pipeline.server.responses_api.store import ResponseStore
from mm_pipeline.server.sse import SSE_HEADERS, ClientDisconnected, until_disconnected

log = logging.getLogger(__name__)
BodyReader = Callable[[Request, type[BaseModel]], Awaitable[Any]]
_INLINE_ITEMS = 256  # an input of more items than this is turned into the chat on a thread


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
        long_input = isinstance(req.input, list) and len(req.input) > _INLINE_ITEMS
        chat, turn = await asyncio.to_thread(_chat_request, req, history) if long_input else _chat_request(req, history)
        response = ResponseObject.of_request(req, service.config.model_name, store=req.store and store.enabled)
        conversation = history + turn

        def keep() -> None:
            if not response.store or response.status not in ("completed", "incomplete"):
                return
            kept, items = conversation + [response.answer_message()], listed_items(req.input)
            size = store.fits(kept, items)
            if size is None:
                log.info("response %s not stored: its conversation is larger than --responses-store-bytes (%d)",
                         response.id, store.max_bytes)
                return
            store.put(response, kept, size, items)

        info = AnswerInfo()
        try:
            if not req.stream:
                answer = await until_disconnected(request, service.chat(chat, info))
                response_of_chat(response, answer)
                keep()
                info.request_id = response.id
                return JSONResponse(response.model_dump(), headers=info.headers())
            chunks, close = await until_disconnected(request, service.chat_chunks(chat, info))
        except ClientDisconnected:
            return Response(status_code=499)
        info.request_id = response.id

        async def events() -> AsyncIterator[str]:
            async for event in ResponseEvents(response).events(chunks):
                yield event
            keep()

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
    """The chat ``req`` is answered as (a 400 naming what cannot be), and its input as messages."""
    try:
        body, turn = chat_body(req, history)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    try:
        return ChatCompletionRequest.model_validate(body), turn
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
