"""``X-Request-Id`` under ``serve --ray`` as one process answers it (mm_pipeline/server/request_id.py).

Ray Serve's proxy runs its own ``RequestIdMiddleware`` on every request: it sets ``x-request-id``
to a generated id when the client sent none, and appends ``X-Request-ID`` (that id, or the client's,
valid or not) to every answer. Left alone, the ingress took the proxy's id for the client's, answers
carried two ids, and an invalid client id was echoed. Two middlewares put that right:

    client ─► ProxyRequestId ─► Ray's RequestIdMiddleware ─► ... ─► IngressRequestId ─► our app
              (in the proxy: Serve's proxy callback,                (in the ingress replica,
               wrapped outside Ray's)                                outside RequestIdHeader)

* ``ProxyRequestId`` moves the client's header, if any, to ``x-mmserve-client-request-id`` and marks
  the request ``x-mmserve-proxied`` (dropping any the client sent itself); a valid client id stays
  in ``x-request-id`` too, so Ray's logs name it, an invalid one is dropped there (Ray generates
  one). On the answer it keeps the first ``X-Request-Id`` -- our app's, which Ray's appended copy
  follows -- and drops the rest; an answer of the proxy's own (no route, backpressure) keeps Ray's.
* ``IngressRequestId``, on a marked request, puts back exactly what the client sent (its header, or
  none) before ``RequestIdHeader`` and the routes read it: a valid header or body ``request_id`` is
  honoured, an invalid header is a 400 and not echoed, as in one process.

The proxy middleware is installed through Ray Serve's proxy callback
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, given to the Serve controller's environment, which
its proxies inherit: ``proxy_env``). It applies only when ``serve --ray`` starts Serve; a Serve
already running without it (KubeRay, an earlier app) leaves requests unmarked, and then the ingress
cannot tell the proxy's id from a client's (docs/serving_on_ray.md).
"""

from __future__ import annotations

from typing import Any

from mm_pipeline.server.request_id import valid_request_id  # light: the proxies import this module

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "mm_pipeline.cluster.serving.request_id_headers.proxy_middlewares"
REQUEST_ID = b"x-request-id"
CLIENT_ID = b"x-mmserve-client-request-id"  # the client's X-Request-Id, as it sent it
PROXIED = b"x-mmserve-proxied"  # ProxyRequestId saw this request: CLIENT_ID is the whole truth

Headers = list[tuple[bytes, bytes]]


def proxy_env() -> dict[str, str]:
    """The environment variables that install ``ProxyRequestId`` in Serve's proxies."""
    return {PROXY_CALLBACK_ENV: PROXY_CALLBACK}


def proxy_middlewares() -> list[Any]:
    """Serve's proxy callback: the middlewares it wraps outside its own."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyRequestId)]


def _split(headers: Headers, *names: bytes) -> tuple[list[bytes], Headers]:
    """(values of the first of ``names``, the headers without any of ``names``)."""
    values = [v for k, v in headers if k.lower() == names[0]]
    return values, [(k, v) for k, v in headers if k.lower() not in names]


class ProxyRequestId:
    """Pure ASGI middleware in Serve's proxy, outside Ray's ``RequestIdMiddleware``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given, headers = _split(list(scope["headers"]), REQUEST_ID, CLIENT_ID, PROXIED)
        headers.append((PROXIED, b"1"))
        if given:
            headers.append((CLIENT_ID, given[0]))
            if valid_request_id(given[0].decode("latin-1")):
                headers.append((REQUEST_ID, given[0]))  # Ray's logs name the client's id
        scope = {**scope, "headers": headers}

        async def send_one_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                ids, rest = _split(list(message.get("headers", ())), REQUEST_ID)
                if len(ids) > 1:
                    message = {**message, "headers": rest + [(REQUEST_ID, ids[0])]}
            await send(message)

        await self.app(scope, receive, send_one_id)


class IngressRequestId:
    """Pure ASGI middleware of the ingress's app, outside ``RequestIdHeader``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and any(k == PROXIED for k, _ in scope["headers"]):
            given, headers = _split(list(scope["headers"]), CLIENT_ID, REQUEST_ID, PROXIED)
            if given:
                headers.append((REQUEST_ID, given[0]))
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)
