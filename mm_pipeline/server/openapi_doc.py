"""The OpenAPI schema at ``/openapi.json``, with what the routes cannot tell FastAPI themselves.

The completion routes (and /tokenize, /detokenize) read their JSON body by hand (``request_body.parse_body``:
a size cap while reading, big bodies parsed off the event loop), so FastAPI sees no body model and
the handlers return ``Response`` objects, so it sees no response model either. This fills both in
from the pydantic models of ``protocol.py`` -- the request bodies, the 200 answers (JSON, or SSE
when streamed) and one error body for every 4xx / 5xx -- so clients and schema-driven tests
(schemathesis, see tests/mm_pipeline/server/test_schema_fuzz.py) see the real contract.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from mm_pipeline.server.audio.protocol import Transcription, form_schema
from mm_pipeline.server.batches.protocol import BatchCreate, BatchList, BatchObject
from mm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest, Invocation
from mm_pipeline.server.responses_api.output import ResponseObject
from mm_pipeline.server.responses_api.protocol import ResponsesRequest
from mm_pipeline.server.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from mm_pipeline.server.responses import (ChatCompletion, Completion, DetokenizeResponse, ErrorResponse, FileList,
                                          FileObject, ModelCard, TokenizeResponse, VersionResponse)

_REF = "#/components/schemas/{model}"
# OpenAPI before 3.2: the schema of an event-stream describes one event (sse.py: ``data:`` lines
# holding a chunk as JSON, the last one ``[DONE]``)
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}

# (method, path) -> (request body model or None, 200 JSON model or None, 200 may be an SSE stream)
_ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel] | None, bool]] = {
    ("post", "/v1/chat/completions"): (ChatCompletionRequest, ChatCompletion, True),
    ("post", "/v1/completions"): (CompletionRequest, Completion, True),
    ("post", "/v1/files"): (None, FileObject, False),
    ("get", "/v1/files"): (None, FileList, False),
    ("get", "/v1/files/{file_id}"): (None, FileObject, False),
    ("get", "/v1/models/{model_id}"): (None, ModelCard, False),
    ("post", "/tokenize"): (TokenizeRequest, TokenizeResponse, False),
    ("post", "/detokenize"): (DetokenizeRequest, DetokenizeResponse, False),
    ("get", "/version"): (None, VersionResponse, False),
    ("post", "/invocations"): (Invocation, None, True),
    ("post", "/v1/audio/transcriptions"): (None, Transcription, True),
    ("post", "/v1/audio/translations"): (None, Transcription, True),
    ("post", "/v1/responses"): (ResponsesRequest, ResponseObject, True),
    ("get", "/v1/responses/{response_id}"): (None, ResponseObject, False),
    ("post", "/v1/responses/{response_id}/cancel"): (None, ResponseObject, False),
    ("post", "/v1/batches"): (BatchCreate, BatchObject, False),
    ("get", "/v1/batches"): (None, BatchList, False),
    ("get", "/v1/batches/{batch_id}"): (None, BatchObject, False),
    ("post", "/v1/batches/{batch_id}/cancel"): (None, BatchObject, False),
}
# routes whose body is a multipart form (server/audio/): the form's schema, and a text/plain answer too
_FORMS = {("post", "/v1/audio/transcriptions"), ("post", "/v1/audio/translations")}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` serves) the documented schema."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel], mode: str) -> dict[str, str]:
        js = model.model_json_schema(ref_template=_REF, mode=mode)  # type: ignore[arg-type]
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        return {"$ref": _REF.format(model=model.__name__)}

    error = {"description": "an error",
             "content": {"application/json": {"schema": ref(ErrorResponse, "serialization")}}}
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            body, answer, streams = _ROUTES.get((method, path), (None, None, False))
            if body is not None:
                op["requestBody"] = {"required": True,
                                     "content": {"application/json": {"schema": ref(body, "validation")}}}
            if (method, path) in _FORMS:
                op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": form_schema()}}}
            ok = op.setdefault("responses", {}).setdefault("200", {"description": "OK"})
            if answer is not None:
                ok["content"] = {"application/json": {"schema": ref(answer, "serialization")}}
            if (method, path) in _FORMS:
                ok["content"]["text/plain"] = {"schema": {"type": "string"}}
            if streams:
                ok.setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
            op["responses"].pop("422", None)  # validation failures are 400 here (errors.py)
            op["responses"]["4XX"] = op["responses"]["5XX"] = error
    return schema
