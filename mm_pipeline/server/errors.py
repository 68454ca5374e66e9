"""OpenAI-shaped error responses, and the one table that turns an error type into an HTTP status.

Every error the server answers looks like OpenAI's, plus the pipeline's error kind when it has one:

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null,
               "kind": "invalid_input"}}

``APIError`` is what handlers raise on purpose (auth, unknown model, body too large). A pipeline
error (``mm_pipeline.errors``) gets its status from ``STATUS_OF`` by its type: the first class of
its MRO found there, so a subclass without a row answers like its parent. Overload answers carry a
``Retry-After`` header; request validation failures become 400 naming the offending field.
Anything else is a bug: 500 with the exception type, never a traceback. Nothing here reads an
error's message to classify it.

What the client reads names the problem, never internals: the text an error quotes of its cause
(codec, PIL or torch messages, ``<_io.BytesIO object at 0x...>``) and the detail of an internal
failure stay in the server log. Each rejected request is one log line (``log_rejection``); only an
unexpected exception (a bug) logs a traceback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mm_pipeline.errors import (ContextLengthError, InternalError, InvalidInputError,
                                MediaAccessDenied, MediaError, MediaFetchTimeout, MediaNotFound, MediaTooLarge,
                                MMServeError, OverloadedError, ServerBusy, UnsupportedMediaType)
from mm_pipeline.server.request_id import request_id_of

log = logging.getLogger("mmserve.server")

# HTTP status -> OpenAI error "type".
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


@dataclass(frozen=True)
class HTTPAnswer:
    """How the server answers one error type: the status and OpenAI's ``code`` (if it has one)."""

    status: int
    code: str | None = None


STATUS_OF: dict[type, HTTPAnswer] = {
    InvalidInputError: HTTPAnswer(400),
    ContextLengthError: HTTPAnswer(400, "context_length_exceeded"),  # what OpenAI answers
    MediaError: HTTPAnswer(400),
    MediaAccessDenied: HTTPAnswer(403),
    MediaNotFound: HTTPAnswer(404),
    MediaFetchTimeout: HTTPAnswer(408),
    MediaTooLarge: HTTPAnswer(413),
    UnsupportedMediaType: HTTPAnswer(415),
    OverloadedError: HTTPAnswer(429),  # this server has no room now; the client may retry
    ServerBusy: HTTPAnswer(503),
    InternalError: HTTPAnswer(500),
    MMServeError: HTTPAnswer(500),
}


def http_answer(error_type: type[MMServeError]) -> HTTPAnswer:
    """The answer for an error type (by type alone: the message plays no part)."""
    for cls in error_type.__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    raise TypeError(f"{error_type.__name__} is not an MMServeError")


class APIError(Exception):
    """An error the client should see as ``status`` with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, kind: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.kind = kind
        self.detail = detail  # for the server log only, never sent

    def body(self) -> dict[str, Any]:
        """The JSON body of this error (also the payload of a stream's error event)."""
        return error_body(self.status, self.message, param=self.param, code=self.code, kind=self.kind)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               kind: str | None = None) -> dict[str, Any]:
    """The JSON body of an OpenAI error (``kind`` added when the error has one)."""
    error: dict[str, Any] = {"message": message, "type": _TYPES.get(status, "api_error"), "param": param,
                             "code": code}
    if kind is not None:
        error["kind"] = kind
    return {"error": error}


INTERNAL_MESSAGE = "internal error while serving this request (the server log has the details)"


def public_message(exc: MMServeError) -> str:
    """The sentence the client reads: the error's message without the text it quotes of its cause
    (``raise MediaError(f"... ({exc})") from exc``) and without object reprs. An internal error
    says only that it happened."""
    if http_answer(type(exc)) == STATUS_OF[InternalError]:
        return INTERNAL_MESSAGE
    message = str(exc) or type(exc).__name__
    cause = exc.__cause__
    if isinstance(cause, MMServeError):  # our own error wrapped with context: its sentence, cleaned
        message = message.replace(str(cause), public_message(cause))
    elif cause is not None and str(cause):  # a library's text (codec, PIL, torch): log only
        message = message.replace(f" ({cause})", "").replace(str(cause), "(details in the server log)")
    return _without_reprs(message)


def _without_reprs(text: str) -> str:
    """``"cannot identify image file <_io.BytesIO object at 0x7f..>"`` -> ``"... image file the data"``."""
    out, i = [], 0
    while (at := text.find(" object at 0x", i)) != -1:
        start, end = text.rfind("<", i, at), text.find(">", at)
        if start == -1 or end == -1:
            break
        out.append(text[i:start] + "the data")
        i = end + 1
    return "".join(out) + text[i:]


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception a handler may meet to an ``APIError`` by its type (unknown ones to 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, MMServeError):
        answer = http_answer(type(exc))
        retry = exc.retry_after if isinstance(exc, OverloadedError) else None
        # a message, part or media item names where it is: the param, dotted as a validation error's
        param = ".".join(map(str, exc.loc)) or None
        return APIError(answer.status, public_message(exc), param=param, code=answer.code, retry_after=retry,
                        kind=exc.kind, detail=f"{type(exc).__name__}: {exc}")  # the whole text, for the log line
    log.exception("internal error", exc_info=exc)  # a bug: the one traceback
    return APIError(500, f"internal server error ({type(exc).__name__})", kind=InternalError.kind,
                    detail="traceback above")


def log_rejection(err: APIError, method: str, path: str, request_id: str | None = None) -> None:
    """One line per rejected request: its id (the answer's ``X-Request-Id``, request_id.py), status,
    route, what the client read, and the detail it did not read. Overload and client errors are
    routine (no traceback); server errors are warnings."""
    level = logging.WARNING if err.status >= 500 else logging.INFO
    detail = f" [{err.detail}]" if err.detail and err.detail != err.message else ""
    named = f"{request_id}: " if request_id else ""  # printable ASCII without spaces, or uuid hex
    # the path as a repr: a client's %0a must not start a line of its own in the log
    log.log(level, "%s%s %r -> %d %s%s", named, method, path[:200], err.status, err.message, detail)


def error_response(err: APIError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if err.status == 408:  # RFC 9110: a server that times a request out closes the connection (the
        headers["Connection"] = "close"  # rest of the body would otherwise hold it open)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _clean_loc(loc) -> list[str]:
    """Field path without pydantic's union-branch markers (``list[...]``, ``str``) and without
    FastAPI's part of the request it names first (``query.limit`` is the client's ``limit``)."""
    if loc and loc[0] in ("query", "path", "header"):
        loc = loc[1:]
    kept = [p for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    # a content part's tag, then its field of the same name (OpenAI's parts: {"type": "file", "file":
    # ...}): pydantic's tagged union names both, the client wrote one (content.0.file, not .file.file)
    return [str(p) for i, p in enumerate(kept)
            if not (i >= 2 and p == kept[i - 1] and isinstance(kept[i - 2], int))]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    return validation_message(exc.errors())


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) of a request's pydantic errors, as a 400 names them: the route's body and a
    batch line alike."""
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        ctx = errors[0].get("ctx") or {}
        return f"request body is not valid JSON ({ctx.get('error', errors[0].get('msg'))})", None
    # a value that fits no branch of a union yields one error per branch: the deepest one is the
    # branch the client meant (a list of parts, not a string); among equally deep ones the one that
    # got furthest (a long list stops at its first bad item, fail_fast: the branch that took more
    # items, e.g. a prompt of id lists with a string at 1, not a list of strings failing at 0)
    first = max(errors, key=lambda e: (len(e.get("loc", ())), [p for p in e.get("loc", ()) if isinstance(p, int)]))
    param = ".".join(_clean_loc(first.get("loc", ()))) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error leave the app in OpenAI's shape."""

    def reject(request: Request, err: APIError) -> JSONResponse:
        log_rejection(err, request.method, request.url.path, request_id_of(request.scope))
        return error_response(err)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return reject(request, exc)

    @app.exception_handler(MMServeError)
    async def _pipeline(request: Request, exc: MMServeError) -> JSONResponse:
        return reject(request, to_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return reject(request, APIError(400, message, param=param, kind=InvalidInputError.kind))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        answer = reject(request, APIError(exc.status_code, str(exc.detail)))
        for name, value in (exc.headers or {}).items():  # Starlette's own: a 405's Allow (RFC 9110)
            answer.headers.setdefault(name, value)
        return answer

    # Any other exception (a bug) is answered by the app's outer middleware (access.py AuthAndCount):
    # a handler registered here for ``Exception`` would answer too, but Starlette then re-raises it
    # to the server, which logs a second traceback.
