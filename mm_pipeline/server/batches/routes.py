"""OpenAI's Batch API (what ``client.batches.create / retrieve / list / cancel`` send), over the
server's file store and engine (runner.py):

    POST /v1/batches                 {"input_file_id", "endpoint", "completion_window": "24h", "metadata"}
    GET  /v1/batches?limit=&after=   newest first (limit 1-100, default 20)
    GET  /v1/batches/{id}
    POST /v1/batches/{id}/cancel     a waiting batch is cancelled at once, a running one cancelling until
                                     its lines in flight are aborted; 409 once it is finalizing (every line
                                     answered or expired, its files being written) or has ended

The input file is uploaded first (``POST /v1/files``, purpose ``batch``); the results are files of
the same store (``GET /v1/files/{output_file_id}/content``)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from mm_pipeline.server.batches.protocol import BatchCreate
from mm_pipeline.server.batches.runner import BatchRunner

BodyReader = Callable[[Request, type[BaseModel]], Awaitable[Any]]


def install_batch_routes(app: FastAPI, runner: BatchRunner, read_body: BodyReader) -> None:
    """Add the four routes; ``read_body`` reads a JSON body under the server's size limits (request_body.parse_body)."""

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        return JSONResponse(runner.create(await read_body(request, BatchCreate)).model_dump())

    @app.get("/v1/batches")
    async def list_batches(limit: int = Query(default=20, ge=1, le=100), after: str | None = None) -> JSONResponse:
        return JSONResponse(runner.list(limit, after).model_dump())

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(runner.get(batch_id).model_dump())

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(runner.cancel(batch_id).model_dump())
