"""FastAPI application: a thin layer of pydantic models in, JSON or SSE out.

    create_app(engine, settings) -> FastAPI
      /v1/chat/completions  /v1/completions       -> ChatService (streams: SSE ending in [DONE])
      /v1/files ...                                -> FilesStore (uploads streamed to disk)
      /v1/models  /health  /metrics
      /ping  /invocations                          -> SageMaker's contract: /health, and a chat or completion
      /tokenize  /detokenize  /version             -> vLLM's utility endpoints (tokenize/routes.py)
      /v1/audio/transcriptions  /v1/audio/translations -> OpenAI's audio API, as chats (audio/routes.py)
      /v1/responses ...                            -> OpenAI's Responses API, as chats (responses_api/routes.py)
      /  /web/*                                    -> the upload page (web/routes.py)

Nothing here blocks the event loop: generation is the engine's (its own thread), media work runs
in the engine's worker pool, disk I/O goes to threads.  A client that disconnects cancels its
handler, which closes the engine streams (= abort, resources freed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from mm_pipeline.errors import echo
from mm_pipeline.server.completions.answer_info import ENCODER_CACHE_HITS_HEADER, AnswerInfo
from mm_pipeline.server.completions.chat_service import ChatService, ServiceConfig
from mm_pipeline.server.errors import APIError, install_error_handlers
from mm_pipeline.server.files.files_store import FileNotFoundInStore, FileRecord, FilesStore
from mm_pipeline.server.access import AuthAndCount
from mm_pipeline.server.metrics import ServerMetrics, StatsLogger
from mm_pipeline.server.openapi_doc import install_openapi
from mm_pipeline.server.request_observer import RequestObserver
from mm_pipeline.server.request_body import parse_body
from mm_pipeline.server.request_id import MAX_REQUEST_ID_CHARS
from mm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest, Invocation
from mm_pipeline.server.request_id import (REQUEST_ID_HEADER, RequestIdHeader, name_failed_answer, name_request,
                                           valid_request_id)
from mm_pipeline.prompt.reasoning import resolve_reasoning
from mm_pipeline.prompt.tool_calls import resolve_tool_calls
from mm_pipeline.server.responses import FileList, FileObject, ModelCard, cursor_page
from mm_pipeline.server.settings import ServerSettings
from mm_pipeline.server.sse import SSE_HEADERS, ClientDisconnected, until_disconnected
from mm_pipeline.server.files.uploads import receive_upload
from mm_pipeline.server.tokenize.routes import install_tokenize_routes
from mm_pipeline.server.audio.routes import install_audio_routes
from mm_pipeline.server.background_drain import BackgroundDrain
from mm_pipeline.server.batches.routes import install_batch_routes
from mm_pipeline.server.batches.runner import BatchRunner
from mm_pipeline.server.responses_api.background import BackgroundResponses
from mm_pipeline.server.responses_api.routes import install_responses_routes
from mm_pipeline.server.responses_api.store import ResponseStore
from mm_pipeline.server.web.routes import install_web_routes

log = logging.getLogger(__name__)


def _file_object(rec: FileRecord) -> FileObject:
    return FileObject(id=rec.id, bytes=rec.bytes, created_at=rec.created_at, filename=rec.filename,
                      purpose=rec.purpose, content_hash=rec.content_hash)


def create_app(engine: Any, settings: ServerSettings | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an ``OmniEngine`` or anything with its API).

    The app does not own the engine: whoever created it shuts it down."""
    settings = settings or ServerSettings()
    model_name = settings.model_name or getattr(engine, "model_name", "mmserve")
    metrics = ServerMetrics(engine.stats)
    temp_dir = None if settings.files_dir else tempfile.mkdtemp(prefix="mmserve-files-")
    store = FilesStore(settings.files_dir or temp_dir, settings.max_upload_bytes, settings.max_files_total_bytes,
                       settings.max_files)
    if hasattr(engine, "set_file_resolver"):
        engine.set_file_resolver(store.resolve)

    # --reasoning-parser against this model's vocabulary (auto: on for a model with <think> tokens)
    reasoning = resolve_reasoning(settings.reasoning_parser, getattr(engine, "tokenizer", None))
    # --tool-call-parser likewise (auto: on for a model that knows <tool_call>)
    tool_calls = resolve_tool_calls(settings.tool_call_parser, getattr(engine, "tokenizer", None))
    service = ChatService(engine, ServiceConfig(model_name, settings.default_max_tokens,
                                                settings.max_completion_prompts, reasoning=reasoning,
                                                tool_calls=tool_calls,
                                                tokens_as_ids=settings.return_tokens_as_token_ids,
                                                model_aliases=settings.model_aliases),
                          RequestObserver(metrics, settings.log_requests))  # metrics, --enable-log-requests
    if service.defaults.given:  # as vLLM says it: a client that sends no temperature gets the model's
        log.info("sampling defaults: %s (a request's own values win; --generation-config vllm: the built-in "
                 "defaults)", service.defaults.describe())
    started = int(time.time())

    stats_log = StatsLogger(engine.stats, settings.log_stats_interval_s) if settings.log_stats_interval_s else None
    batches = BatchRunner(service, store, settings.batch_concurrency, settings.json_limits)  # /v1/batches
    responses = ResponseStore(settings.responses_store_bytes)  # /v1/responses with store
    background = BackgroundResponses(settings.max_background_responses)  # /v1/responses with background: true
    drain = BackgroundDrain([background, batches])  # what a shutdown does to them (mmserve serve: DrainingServer)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        metrics.lag_monitor.start()
        if stats_log is not None:
            stats_log.start()
        try:
            yield
        finally:
            await drain.finish()  # run on through a drain's grace period, then ended while the engine still runs
            await metrics.lag_monitor.stop()
            if stats_log is not None:
                await stats_log.stop()
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)

    app = FastAPI(title="mmserve", lifespan=lifespan)
    app.state.engine, app.state.store, app.state.metrics, app.state.service = engine, store, metrics, service
    app.state.batches, app.state.background_responses, app.state.drain = batches, background, drain
    app.state.responses = responses
    install_error_handlers(app)
    install_openapi(app)

    app.add_middleware(AuthAndCount, api_key=settings.api_key, metrics=metrics, routes=app.router.routes)
    if settings.allowed_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=settings.allow_credentials,
                           expose_headers=[REQUEST_ID_HEADER, ENCODER_CACHE_HITS_HEADER, "Retry-After"])
    # the outermost: every answer names a request id, the 401, a CORS preflight and a bug's 500 included
    app.add_middleware(RequestIdHeader)
    install_web_routes(app)  # GET / : the upload page

    def read_body(request: Request, model: Any) -> Any:  # a JSON body under the server's limits
        return parse_body(request, model, settings.json_limits, settings.request_body_idle_s)

    install_tokenize_routes(app, engine, service, read_body)
    install_audio_routes(app, service, settings)  # /v1/audio/transcriptions, /v1/audio/translations
    install_responses_routes(app, service, responses, background, read_body)  # /v1/responses
    install_batch_routes(app, batches, read_body)  # /v1/batches

    async def respond(request: Request, body: Any, run, run_stream) -> Response:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is not None:  # the header wins over the body's request_id, as in vLLM
            if not valid_request_id(given):
                raise APIError(400, f"{REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                                    f"characters without spaces", param=REQUEST_ID_HEADER)
            body = body.model_copy(update={"request_id": given})
        elif body.request_id is not None:  # an error answer carries the body's id, as it would the header's
            name_request(request, body.request_id)
        info = AnswerInfo()  # filled before the body starts: its headers go out with a stream too
        try:
            if not body.stream:
                result = await until_disconnected(request, run(body, info))
                return JSONResponse(result.model_dump(exclude_none=False), headers=info.headers())
            events, close = await until_disconnected(request, run_stream(body, info, request.url.path))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        except Exception:
            name_failed_answer(request, info.request_id)  # set once the answer began (None: refused at its start)
            raise
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **info.headers()},
                                 background=BackgroundTask(close))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest)
        return await respond(request, body, service.chat, service.chat_stream)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest)
        return await respond(request, body, service.complete, service.complete_stream)

    # ---- files ------------------------------------------------------------------------------
    def record(file_id: str) -> FileRecord:
        try:
            return store.get(file_id)
        except FileNotFoundInStore:
            raise APIError(404, f"no file with id {echo(file_id)}", param="file_id") from None

    @app.post("/v1/files")
    async def upload_file(request: Request) -> JSONResponse:
        uploaded = await receive_upload(request, store, settings.request_body_idle_s)
        return JSONResponse(_file_object(uploaded).model_dump())

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = Query(default=10_000, ge=1, le=10_000),
                         order: Literal["asc", "desc"] = "desc", after: str | None = None) -> JSONResponse:
        """OpenAI's list: newest first by default, ``limit`` a page (1-10,000), ``after`` a file id."""
        records = store.list(purpose)
        page = cursor_page(records if order == "asc" else records[::-1], lambda r: r.id, limit, after)
        page["data"] = [_file_object(r) for r in page["data"]]
        return JSONResponse(FileList(**page).model_dump())

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> JSONResponse:
        return JSONResponse(_file_object(record(file_id)).model_dump())

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        rec = record(file_id)
        path = store.path(rec.id)
        try:  # stat here: a delete racing the download is a 404, not FileResponse's own stat failing (500)
            st = await asyncio.to_thread(os.stat, path)
        except FileNotFoundError:
            raise APIError(404, f"no file with id {echo(file_id)}", param="file_id") from None
        return FileResponse(path, filename=rec.filename, media_type="application/octet-stream", stat_result=st)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        record(file_id)
        if (batch_id := batches.reading(file_id)) is not None:
            raise APIError(409, f"file {echo(file_id)} is the input of batch {batch_id}, which has not ended: cancel "
                                f"the batch or wait for it before deleting its input", param="file_id")
        try:
            await asyncio.to_thread(store.delete, file_id)
        except FileNotFoundInStore:
            raise APIError(404, f"no file with id {echo(file_id)}", param="file_id") from None
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # ---- models, health, metrics --------------------------------------------------------------
    names = (model_name, *settings.model_aliases)  # as vLLM lists --served-model-name's names: each a card

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=started, root=model_name,
                         max_model_len=getattr(engine, "max_model_len", None))

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(n).model_dump() for n in names]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_id not in names:
            raise APIError(404, f"model {echo(model_id)} does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card(model_id).model_dump())

    # Both read the engine's last published stats snapshot; neither touches engine state.
    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            stats = engine.stats()
        except Exception as exc:
            return JSONResponse({"status": "unhealthy", "error": f"{type(exc).__name__}: {exc}"}, status_code=503)
        body: dict[str, Any] = {"status": "ok"}
        if hasattr(stats, "to_dict"):
            body["stats"] = stats.to_dict()
        return JSONResponse(body)

    # SageMaker's serving contract (vLLM serves it too): /ping is /health, and /invocations takes a
    # chat or a completion body and answers as that route does
    @app.get("/ping")
    @app.post("/ping")  # a route per method: one operation id each in the OpenAPI schema
    async def ping() -> JSONResponse:
        return await health()

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        body = (await read_body(request, Invocation)).root
        if isinstance(body, ChatCompletionRequest):
            return await respond(request, body, service.chat, service.chat_stream)
        return await respond(request, body, service.complete, service.complete_stream)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.scrape(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return app
