"""``POST /tokenize``, ``POST /detokenize``, ``GET /version``: the vLLM OpenAI server's utility
endpoints, in vLLM's shapes, for the scripts written against them.

    POST /tokenize    {"prompt": str, "add_special_tokens": true}                       (text form)
                      {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                       "chat_template_kwargs": {...}, "add_special_tokens": false}      (chat form)
                      -> {"count", "max_model_len", "tokens", "token_strs"}  (token_strs: null unless
                         "return_token_strs": true)
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /version     -> {"version": "<mmserve's package version>"}

The tokens are the engine's own (``engine.prompt_token_ids``, runtime/omni_engine.py): the chat form
is the prompt /v1/chat/completions prefills for the same messages and template fields -- the same
parse (protocol.py, chat_service.parsed_messages), the same ``OmniRuntime.prepare_chat``, no second
template path -- so ``count`` equals that answer's ``usage.prompt_tokens``.

Media parts (images, videos, audio) are tokenized exactly, placeholders expanded: their size is known
before anything is encoded (the pipeline's whole design: the prompt is laid out, then the encoder
output streams into it), so ``prepare_chat`` gives the expanded ids without running an encoder. It
does do the planning half of a request: the media is fetched or read, hashed and sized from the
encoder cache's manifest or its metadata (an image's header, a video's probe; an audio clip or a
video's sound track decoded to count its segments), under the same limits and with the same errors
(400 / 403 / 404 / 413 / 415) as a chat request; the plans are then dropped. Cached media costs its
manifest only: the plans are layout-only (``MediaPlanner.plan``), so the encoder rows a chat request
would take from the cache are not read, and the cache's hit counters count none. Answering a 400 for
media instead would leave a vLLM user no way to count a multimodal prompt, the one whose size is
hard to guess.

Unlike vLLM, a prompt that cannot be served because it leaves no room in the context is a 400
(``context_length_exceeded``, as /v1/chat/completions answers it), not a count: the layout bounds
its work by the context (a chat or text that cannot fit fails before it is tokenized whole), and
the ids of a prompt the server would refuse are not ids it would run.

A text prompt is served without the tokenizer's special tokens (/v1/completions); ``add_special_tokens``
(true by default, as in vLLM) adds them here: with the MiMo and demo tokenizers (no BOS) nothing changes.
The chat form takes ``add_special_tokens: false`` only, what /v1/chat/completions takes. The routes sit
outside ``/v1`` as in vLLM, behind the API key like every route but /health and the upload page
(access.needs_key).
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from mm_pipeline.server.completions.chat_service import ChatService
from mm_pipeline.server.completions.request_params import parsed_messages
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from mm_pipeline.server.responses import DetokenizeResponse, TokenizeResponse, VersionResponse
from mm_pipeline.server.sse import ClientDisconnected, until_disconnected

BodyReader = Callable[[Request, type[BaseModel]], Awaitable[Any]]
_INLINE_IDS = 4096  # more ids than this are decoded (or turned into strings) on a thread


def package_version() -> str:
    """mmserve's installed version (pyproject.toml's), or "unknown" when run from an uninstalled tree."""
    try:
        return metadata.version("mmserve")
    except metadata.PackageNotFoundError:
        return "unknown"


async def _off_loop_if_long(ids: list[int], fn: Callable[[list[int]], Any]) -> Any:
    return await asyncio.to_thread(fn, ids) if len(ids) > _INLINE_IDS else fn(ids)


def install_tokenize_routes(app: FastAPI, engine: Any, service: ChatService, read_body: BodyReader) -> None:
    """Add the three routes over ``engine`` (OmniEngine's API: ``tokenizer``, ``max_model_len``,
    ``prompt_token_ids``); ``service`` checks the model name as the completion routes do,
    ``read_body`` reads a JSON body under the server's size limits (request_body.parse_body)."""
    version = package_version()

    def tokenizer() -> Any:
        tok = getattr(engine, "tokenizer", None)
        if tok is None:
            raise APIError(400, "this model has no tokenizer: there is nothing to tokenize or detokenize with")
        return tok

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body: TokenizeRequest = await read_body(request, TokenizeRequest)
        service.check_model(body.model)
        tok = tokenizer()
        if body.messages is not None:
            work = engine.prompt_token_ids(messages=await parsed_messages(body))
        else:
            work = engine.prompt_token_ids(prompt=body.prompt, add_special_tokens=body.special_tokens)
        try:  # media may take a while to fetch and plan: a client that leaves cancels it
            ids = await until_disconnected(request, work)
        except ClientDisconnected:
            return Response(status_code=499)
        strs = None
        if body.return_token_strs:
            strs = [s if s is not None else "" for s in await _off_loop_if_long(ids, tok.convert_ids_to_tokens)]
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                             token_strs=strs).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body: DetokenizeRequest = await read_body(request, DetokenizeRequest)
        service.check_model(body.model)
        tok = tokenizer()
        ids, limit = body.tokens, engine.max_model_len
        if len(ids) > limit:
            raise APIError(400, f"tokens holds {len(ids)} ids, more than the context limit of {limit} tokens "
                                f"(max_model_len)", param="tokens")
        vocab = len(tok)
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                shown = t if abs(t) < 1 << 63 else ("a huge negative number" if t < 0 else "a huge number")
                what = "negative" if t < 0 else "out of the vocabulary"
                raise APIError(400, f"tokens[{i}] is {shown}: {what}; this tokenizer's ids are 0 to {vocab - 1}",
                               param="tokens")
        text = await _off_loop_if_long(ids, tok.decode)  # special tokens kept, as vLLM answers
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse(VersionResponse(version=version).model_dump())
