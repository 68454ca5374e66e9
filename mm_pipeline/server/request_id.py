"""Every HTTP answer of the server names a request id in ``X-Request-Id`` (as vLLM's request-id
headers do), so a proxy or a client can match any answer, an error above all, with the server's log.

    the header's value, the first that applies:
      1. the answer's id, where the route made an answer (chatcmpl-…, cmpl-…, resp_…): the route
         sends the header itself (``AnswerInfo.headers``); a client's id is inside it (chatcmpl-<id>)
      2. the client's own id: a valid ``X-Request-Id`` request header, else the body's
         ``request_id`` field where the route takes one (the route names it: ``name_request``)
      3. a fresh one (uuid4 hex)

``RequestIdHeader`` (the app's outermost middleware) fills in 2 or 3 wherever the route sent no
header: errors of every kind (the key check's 401, a 404 or 405, a body that does not validate, a
413 over a limit, a stream that fails before its first byte, a bug's 500), /health, /metrics,
/v1/models, a CORS preflight. An invalid client id is never echoed: the answer carries a fresh one
(the completion routes, which take the id, still answer it 400). The error handlers' log line names
the same id (``request_id_of``).
"""

from __future__ import annotations

import uuid

from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request

from mm_pipeline.server.completions.sampling_fields import RequestId

REQUEST_ID_HEADER = "X-Request-Id"
_HEADER_KEY = REQUEST_ID_HEADER.lower().encode("latin-1")  # ASGI header names are lower-case bytes
_STATE_KEY = "request_id"  # the request's id in scope["state"] (``request.state.request_id``)
_VALID = TypeAdapter(RequestId)  # a header is checked as the request_id field is


def valid_request_id(value: str) -> bool:
    """Whether ``value`` may name a request: 1 to 128 printable ASCII characters without spaces
    (``sampling_fields.RequestId``), so it can go into a header and a log line as it is."""
    try:
        _VALID.validate_python(value)
    except ValidationError:
        return False
    return True


def request_id_of(scope: dict) -> str | None:
    """The id the answer to ``scope`` carries unless its route names an answer (None outside the
    middleware: a bare app in a test)."""
    return scope.get("state", {}).get(_STATE_KEY)


def name_request(request: Request, request_id: str) -> None:
    """A route's word that the client named its request in the body (``request_id``, checked)."""
    request.state.request_id = request_id


class RequestIdHeader:
    """Pure ASGI middleware (streams pass through untouched), the app's outermost: gives each HTTP
    request its id before any inner layer runs, and adds the header to an answer without one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == _HEADER_KEY), None)
        rid = given if given is not None and valid_request_id(given) else uuid.uuid4().hex
        # a dict of this request's own (the server may hand every request the same lifespan state),
        # shared by every copy of the scope made further in
        state = scope["state"] = {**scope.get("state", {}), _STATE_KEY: rid}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == _HEADER_KEY for k, _ in headers):
                    headers.append((_HEADER_KEY, state[_STATE_KEY].encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
