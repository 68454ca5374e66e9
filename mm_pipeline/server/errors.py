"""OpenAI-shaped error responses and the mapping from exceptions to HTTP statuses.

Every error the server answers looks like OpenAI's:

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

``APIError`` is what handlers raise on purpose; ``MediaError`` (from the media stages) carries its
own status; the engine's overload error becomes 429 (queue full) / 503 (shutting down) with a
``Retry-After`` header; request validation failures become 400 naming the offending field.
Anything else is a bug: 500 with the exception type, never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mm_pipeline.errors import MediaError

log = logging.getLogger("mmserve.server")

# HTTP status -> OpenAI error "type".
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client should see as ``status`` with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The JSON body of an OpenAI error."""
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param,
                      "code": code}}


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception a handler may meet to an ``APIError`` (unknown ones to 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, MediaError):
        return APIError(exc.status, str(exc) or type(exc).__name__,
                        retry_after=1.0 if exc.status == 503 else None)
    overload = _overload_error(exc)
    if overload is not None:
        return overload
    log.exception("internal error", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__})")


def _overload_error(exc: BaseException) -> APIError | None:
    try:  # the engine module loads torch and the model code: import it only when needed
        from mm_pipeline.runtime.omni_engine import OverloadedError
    except ImportError:
        return None
    if not isinstance(exc, OverloadedError):
        return None
    status = int(getattr(exc, "status", 429))
    retry = float(getattr(exc, "retry_after", 1.0) or 1.0)
    return APIError(status if status in (429, 503) else 429, str(exc) or "server overloaded", retry_after=retry)


def error_response(err: APIError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(err.status, err.message, param=err.param, code=err.code),
                        status_code=err.status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _clean_loc(loc) -> list[str]:
    """Field path without pydantic's union-branch markers (``list[...]``, ``str``)."""
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        ctx = errors[0].get("ctx") or {}
        return f"request body is not valid JSON ({ctx.get('error', errors[0].get('msg'))})", None
    # a value that fits no branch of a union yields one error per branch: the deepest one is the
    # branch the client meant (a list of parts, not a string)
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = ".".join(_clean_loc(first.get("loc", ()))) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error leave the app in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(MediaError)
    async def _media(_: Request, exc: MediaError) -> JSONResponse:
        return error_response(to_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))
