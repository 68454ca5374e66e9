"""The app's middleware around its routes (pure ASGI; only request_id.py's and CORS are outside it):
the API key (``--api-key``: ``Authorization: Bearer``) for every route but the open ones, the
in-flight gauge and per-route status counts of /metrics, and the answer to an exception no handler
took."""

from __future__ import annotations

import hmac

from starlette.requests import ClientDisconnect
from starlette.routing import Match

from mm_pipeline.server.errors import APIError, error_response, log_rejection, to_api_error
from mm_pipeline.server.metrics import ServerMetrics
from mm_pipeline.server.request_id import request_id_of

# Open without the API key: the liveness probe and the upload page with its static files (the
# page's own calls go to /v1, which needs the key). Everything else -- /v1, vLLM's /tokenize,
# /detokenize and /version, /metrics and the schema and docs pages (/openapi.json, /docs, /redoc) --
# needs it when one is set.
_OPEN_PATHS = ("/health", "/ping", "/")
_OPEN_PREFIXES = ("/web/",)


def needs_key(path: str) -> bool:
    """``path``: as the app routes it (``route_path``), not as it came: behind --root-path the open
    paths are /prefix/health and so on, and a liveness probe must not need the key there either."""
    return path not in _OPEN_PATHS and not path.startswith(_OPEN_PREFIXES)


def route_path(scope: dict) -> str:
    """The request's path less the root path in front of it (uvicorn and Ray's proxy keep
    ``--root-path`` in ``scope["path"]``), as Starlette's routing reads it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def route_template(routes: list, scope: dict) -> str:
    """The path template of the route ``scope`` would reach (``/v1/files/{file_id}``), or
    ``"other"``: a metric label must not grow with the paths clients make up."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return getattr(route, "path", "other")
    return "other"


def bearer_matches(headers: list[tuple[bytes, bytes]], key: bytes) -> bool:
    """``Authorization: Bearer <key>``, compared as bytes (a header may hold any byte)."""
    given = dict(headers).get(b"authorization", b"")
    scheme, _, token = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class AuthAndCount:
    """Pure ASGI middleware (streams and disconnects pass through untouched), inside the request
    id's (request_id.py: its answers carry the id too) and CORS: API-key check (``needs_key``),
    in-flight gauge, per-route status counts, and the answer to an exception no handler took (a
    bug: one traceback, a 500, nothing re-raised)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, routes: list) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes
        self.key = None if api_key is None else api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key is not None and needs_key(route_path(scope)) and not bearer_matches(scope["headers"], self.key):
            self.metrics.count_request(route_template(self.routes, scope), 401)
            err = APIError(401, "missing or invalid API key (Authorization: Bearer ...)")
            log_rejection(err, scope["method"], scope["path"], request_id_of(scope))
            await error_response(err)(scope, receive, send)
            return
        status = 500
        started = False

        async def send_and_note(message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        self.metrics.http_in_flight.inc()
        try:
            await self.app(scope, receive, send_and_note)
        except ClientDisconnect:  # gone while its body was read: nobody to answer, nothing to log
            status = 499
        except Exception as exc:  # noqa: BLE001 -- no handler took it: answer 500 here, once
            err = to_api_error(exc)
            log_rejection(err, scope["method"], scope["path"], request_id_of(scope))
            if not started:
                status = err.status
                await error_response(err)(scope, receive, send)
        finally:
            self.metrics.http_in_flight.dec()
            # FastAPI's routes put themselves in the scope; Starlette's plain ones (/docs,
            # /openapi.json) do not, and are found by their template as a 401 is
            route = getattr(scope.get("route"), "path", None) or route_template(self.routes, scope)
            self.metrics.count_request(route, status)
