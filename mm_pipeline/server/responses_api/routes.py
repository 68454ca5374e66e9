"""OpenAI's Responses API: ``POST /v1/responses`` (what ``client.responses.create`` sends), streamed or
not or in the background, ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and
``DELETE /v1/responses/{id}`` for stored (and running background) responses, ``POST
/v1/responses/{id}/cancel`` for background ones.

A request becomes a chat (protocol.py: input items -> messages, instructions -> a system message
first, the previous response's conversation before them) and is answered by the same ChatService as
/v1/chat/completions: the same admission, limits, media pipeline, encoder and prefix caches,
reasoning and tool-call parsers, errors and disconnect handling. The answer is reshaped into output
items (output.py; streamed: events.py). With ``store`` (the default) the response and its
conversation are kept for ``previous_response_id`` and GET (store.py). With ``background`` the POST
answers at once (``queued``) and a task of the server's answers the same chat, by the same
``service.chat`` and ``response_of_chat`` as a foreground request (background.py). Not served:
streaming a background response or resuming a stream (``GET ?stream=true``: a 400), the
Conversations API.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from mm_pipeline.errors import InvalidMessageError, MMServeError, OverloadedError, Where, echo
from mm_pipeline.server.completions.answer_info import AnswerInfo
from mm_pipeline.server.batches.lines import retry_overloaded
from mm_pipeline.server.completions.chat_service import ChatService
from mm_pipeline.server.errors import APIError, to_api_error
from mm_pipeline.server.protocol import ChatCompletionRequest
from mm_pipeline.server.request_id import REQUEST_ID_HEADER, name_failed_answer
from mm_pipeline.server.responses_api.as_chat import chat_body
from mm_pipeline.server.responses_api.background import BackgroundResponses
from mm_pipeline.server.responses_api.events import ResponseEvents
from mm_pipeline.server.responses_api.output import ResponseObject, response_of_chat
from mm_pipeline.server.responses_api.protocol import FunctionCallOutputItem, MessageItem, ResponsesRequest, listed_items
from mm_pipeline.server.responses_api.store import ResponseStore, StoredResponse, entry_bytes
from mm_pipeline.server.sse import SSE_HEADERS, ClientDisconnected, until_disconnected

log = logging.getLogger(__name__)
BodyReader = Callable[[Request, type[BaseModel]], Awaitable[Any]]
# Past this many messages and input items, the chat a request becomes is built and validated on a
# thread (~7 us a message: a follow-up of a 200 K-message conversation held the loop for 1.4 s), and
# the entry to store sized there too. A stored entry of more values than _INLINE_VALUES is sized on
# a thread as well (~0.4 us a value: many logprobs, big tool schemas); counting stops there.
_INLINE_ITEMS = 256
_INLINE_VALUES = 1024


def install_responses_routes(app: FastAPI, service: ChatService, store: ResponseStore,
                             background: BackgroundResponses, read_body: BodyReader) -> None:
    """Add the routes; ``service`` answers the chat each request becomes, ``store`` keeps responses,
    ``background`` runs the background ones, ``read_body`` reads a JSON body under the server's size
    limits (request_body.parse_body)."""

    # stored responses answered in the foreground now (streamed or not): a DELETE of one (its id is
    # in the stream's first event) answered 404 and it was stored anyway. Weak: an entry goes with
    # its request, however that ends (a stream never started included)
    answering: weakref.WeakValueDictionary[str, _Answering] = weakref.WeakValueDictionary()

    def stored(response_id: str) -> StoredResponse:
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response with id {echo(response_id)}", param="response_id",
                           code="response_not_found")
        return entry

    def current(response_id: str) -> ResponseObject:
        """The response as it stands: a background one still running, else the stored one (404)."""
        running = background.get(response_id)
        return running.response if running is not None else stored(response_id).response

    def previous_history(response_id: str) -> list[dict[str, Any]]:
        """The conversation a follow-up of ``response_id`` continues, its answer last: a 400 naming
        ``previous_response_id`` unless that response is stored and answered."""
        previous = store.get(response_id)
        if previous is None and (running := background.get(response_id)) is not None:
            raise APIError(400, f"previous response {echo(response_id)} is {running.response.status}: continue it once "
                                f"it has completed (poll GET /v1/responses/{response_id})",
                           param="previous_response_id")
        if previous is None:
            raise APIError(400, f"previous response {echo(response_id)} is not stored here (never stored, deleted, or "
                                f"dropped for room: --responses-store-bytes); send the conversation as input "
                                f"instead", param="previous_response_id", code="previous_response_not_found")
        if previous.response.status not in ("completed", "incomplete"):  # a background one that failed or stopped
            raise APIError(400, f"previous response {echo(response_id)} is {previous.response.status}: it has no answer "
                                f"to continue; send the conversation as input instead", param="previous_response_id")
        return previous.history

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await read_body(request, ResponsesRequest)
        service.check_model(req.model)
        if req.background and not store.enabled:
            raise APIError(400, "background responses are read back from the response store, which is off on this "
                                "server (--responses-store-bytes 0)", param="background")
        history = [] if req.previous_response_id is None else previous_history(req.previous_response_id)
        # the chat holds the history too: a one-item follow-up of a long conversation is long
        long = len(history) + (len(req.input) if isinstance(req.input, list) else 1) > _INLINE_ITEMS
        chat, turn, spelled = (await asyncio.to_thread(_chat_request, req, history) if long
                               else _chat_request(req, history))
        response = ResponseObject.of_request(req, service.config.model_name, store=req.store and store.enabled,
                                             defaults=service.defaults)
        conversation = history + turn

        if req.background:  # answered by a task of the server's; listed now: GET .../input_items serves them meanwhile
            items = await asyncio.to_thread(listed_items, req.input) if long else listed_items(req.input)
            background.start(response, items, lambda: _answer(service, response, chat, spelled),
                             lambda: _keep(store, response, conversation, req.input, long, items))
            return JSONResponse(response.model_dump(), headers={REQUEST_ID_HEADER: response.id})

        this = _Answering()
        if response.store:
            answering[response.id] = this

        async def keep() -> None:
            if response.store and response.status in ("completed", "incomplete") and not this.deleted:
                await _keep(store, response, conversation, req.input, long, wanted=lambda: not this.deleted)

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
        except Exception as exc:
            # the chat began (its id in info) and failed: the error names the response it was answering
            name_failed_answer(request, None if info.request_id is None else response.id)
            if isinstance(exc, MMServeError):  # one naming the chat's messages: renamed by the request's input
                raise spelled(exc) from exc.__cause__
            raise
        info.request_id = response.id

        async def events() -> AsyncIterator[str]:
            async for event in ResponseEvents(response).events(chunks):
                yield event
            await keep()

        return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **info.headers()},
                                 background=BackgroundTask(close))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False) -> JSONResponse:
        if stream:
            raise APIError(400, "stream=true (streaming a response's events again, from starting_after) is not served "
                                "by this server: GET without stream returns the response as it stands", param="stream")
        return JSONResponse(current(response_id).model_dump())

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        response = await background.cancel(response_id)
        if response is None:  # not running: one that ended is returned as it is (OpenAI: cancelling twice is a no-op)
            response = stored(response_id).response
            if not response.background:
                raise APIError(400, f"response {echo(response_id)} was not created with background: true; only a "
                                    f"background response can be cancelled", param="response_id")
        return JSONResponse(response.model_dump())

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: int = Query(default=20, ge=1, le=100), after: str | None = None,
                               order: Literal["asc", "desc"] = "desc") -> JSONResponse:
        running = background.get(response_id)
        items = running.input_items if running is not None else stored(response_id).input_items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        await background.cancel(response_id)  # a running one is stopped (and stored) first: nothing stores it later
        if (now := answering.get(response_id)) is not None and not now.deleted:  # answered in the foreground now:
            now.deleted = True  # not stored when it ends (a second DELETE finds nothing: 404)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        stored(response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class _Answering:
    """A stored response answered in the foreground now; ``deleted`` by a DELETE meanwhile."""

    __slots__ = ("deleted", "__weakref__")

    def __init__(self) -> None:
        self.deleted = False


def _chat_request(req: ResponsesRequest, history: list[dict[str, Any]]
                  ) -> tuple[ChatCompletionRequest, list[dict[str, Any]], Callable[[MMServeError], MMServeError]]:
    """The chat ``req`` is answered as (a 400 naming what cannot be, by its Responses name), its
    input as messages, and how to name an error of that chat's messages by the request's input
    (``_input_spelled``)."""
    origins: list[int] = []
    try:
        body, turn = chat_body(req, history, origins)
    except InvalidMessageError as exc:  # a part of the input: the param names it
        raise to_api_error(exc) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    first = (1 if req.instructions else 0) + len(history)  # the input's messages come after these
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": _input_loc(e["loc"], first, origins, req.input)} for e in exc.errors()]
        raise RequestValidationError(errors) from None
    return chat, turn, lambda exc: _input_spelled(exc, first, origins, req.input, len(history))


def _input_loc(loc: tuple[Any, ...], first: int, origins: list[int], items: str | list[Any],
               history: int = 0) -> tuple[Any, ...]:
    """A chat error's location as the request spells it: ``messages.k.content.p`` (k counted from the
    instructions and the ``history`` messages before ``first``) is ``input.i.content.p``, i the item
    message k came from (the part's own fields are the chat's spelling, so the part is named); a
    message of the stored conversation is the request's ``previous_response_id`` (its media can
    fail now: an uploaded file since deleted); other fields as they are."""
    if len(loc) < 2 or loc[0] != "messages" or not isinstance(loc[1], int):
        return loc
    if first - history <= loc[1] < first:
        return ("previous_response_id",)
    if not 0 <= loc[1] - first < len(origins):
        return loc  # the instructions are valid: the request's own text
    if isinstance(items, str):
        return ("input",)
    i = origins[loc[1] - first]
    field = {MessageItem: "content", FunctionCallOutputItem: "output"}.get(type(items[i]))
    if field is None or loc[2:3] != ("content",):
        return ("input", i)
    part = next((p for p in loc[3:] if isinstance(p, int)), None)
    return ("input", i, field) if part is None else ("input", i, field, part)


def _input_spelled(exc: MMServeError, first: int, origins: list[int], items: str | list[Any],
                   history: int = 0) -> MMServeError:
    """``exc`` (the chat parser's, ``messages[k].content[p].image_url.url: unsupported URL ...``, or a
    media item's, ``messages[k].content[p]: cannot decode ...``; any other as it is) as
    the request spells it: ``input[i].content[p]: unsupported URL ...``. The location is
    ``_input_loc``'s; of the chat fields it leaves out, the last one stays in the sentence where
    the sentence goes on from it (``input[3]: arguments must be ...``)."""
    loc, text = exc.loc, str(exc)
    to = Where(_input_loc(loc, first, origins, items, history))
    if not loc or to == loc or not text.startswith(str(loc)):
        return exc
    rest, left = text[len(str(loc)):], [p for p in loc[len(to):] if isinstance(p, str)]
    if left:
        rest = ": " + (rest.removeprefix(":").lstrip() if rest.startswith(":") else left[-1] + rest)
    return exc.located(f"{to}{rest}", to)


async def _answer(service: ChatService, response: ResponseObject, chat: ChatCompletionRequest,
                  spelled: Callable[[MMServeError], MMServeError]) -> None:
    """A background response's answer (background.py): the chat a foreground request gets, answered
    the same way. Its POST was answered already, so there is nobody to tell a 429 to when the
    engine has no room: it is queued again and asked again, as a batch line is."""
    again = retry_overloaded()
    while True:
        response.status = "in_progress"
        try:
            answer = await service.chat(chat)
            break
        except OverloadedError as exc:
            response.status = "queued"
            await again(exc)
        except MMServeError as exc:
            raise spelled(exc) from exc.__cause__
    response_of_chat(response, answer)


async def _keep(store: ResponseStore, response: ResponseObject, conversation: list[dict[str, Any]],
                given: str | list[Any], long: bool, items: list[dict[str, Any]] | None = None, *,
                wanted: Callable[[], bool] = lambda: True) -> None:
    """Store ``response`` with ``conversation`` (its answer added) and its input items (``items``
    when listed already), sized on a thread when big (``long``, or more than _INLINE_VALUES values).
    One larger than the whole store is not kept; a background one leaves a ``failed`` entry
    saying so, since its client is polling for it. ``wanted``: asked again after the sizing (a
    DELETE may come while a big entry is sized), with no await between it and the put."""
    kept = conversation + [response.answer_message()]
    entry = None if long else _sized_entry(response, kept, given, _INLINE_VALUES, items)
    items, size = entry or await asyncio.to_thread(_sized_entry, response, kept, given, None, items)
    if not wanted():
        return
    if store.fits(size):
        store.put(response, kept, size, items)
        return
    log.info("response %s not stored: it is larger than --responses-store-bytes (%d)", response.id, store.max_bytes)
    if response.background:
        # what a client may have made large (the output, and the settings echoed) is left out
        left = response.model_copy(update={"output": [], "usage": None, "instructions": None, "tools": [], "text": {}})
        left.fail("response_too_large", f"the response ended {response.status} but, with its conversation, is larger "
                                        f"than this server's whole response store (--responses-store-bytes "
                                        f"{store.max_bytes}), so it was not kept")
        if store.fits(size := entry_bytes(left, [])):
            store.put(left, [], size)


def _sized_entry(response: ResponseObject, kept: list[dict[str, Any]], given: str | list[Any],
                 max_values: int | None = None,
                 items: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], int] | None:
    """The input items (``items``, else listed from ``given``) and the size (store.entry_bytes) of
    the entry that keeps ``response``; None when it holds more than ``max_values`` values."""
    items = listed_items(given) if items is None else items
    size = entry_bytes(response, kept, items, max_values)
    return None if size is None else (items, size)
