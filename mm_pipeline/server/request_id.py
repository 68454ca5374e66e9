"""Every HTTP answer of the server names a request id in ``X-Request-Id`` (as vLLM's request-id
headers do), so a proxy or a client can match any answer, an error above all, with the server's log.

    the header's value, the first that applies:
      1. the answer's id, where the route made an answer (chatcmpl-…, cmpl-…, resp_…): the route
         sends the header itself (``AnswerInfo.headers``); a client's id is inside it (chatcmpl-<id>)
      2. the client's own id: a valid ``X-Request-Id`` request header, else the body's
         ``request_id`` field where the route takes one (the route names it: ``name_request``)
      3. the answer's id where the answer began but failed before it was sent (not streamed: the
         engine failed mid-generation, a 500 or 503, or ended the request as invalid, a 400): the
         chat, completion, response and transcription routes name it (``name_failed_answer``), as
         the request log (a response's: its chat's id) and a stream's error event do
      4. a fresh one (uuid4 hex)

``RequestIdHeader`` (the app's outermost middleware) fills in 2 to 4 wherever the route sent no
header: errors of every kind (the key check's 401, a 404 or 405, a body that does not validate, a
413 over a limit, a request the engine refuses at its start, a stream that fails before its first
byte, a bug's 500), /health, /metrics, /v1/models, a CORS preflight. An invalid client id is never
echoed: the answer carries a fresh one (the completion routes, which take the id, still answer it
400). The error handlers' log line names the same id (``request_id_of``).

A request head over the server's bound (launch/http_protocol.py) is answered 431 before the app
runs: that answer carries a fresh id of its own, which its log line names (the client's header may
lie past the cut).
"""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request

# What may name a request (the X-Request-Id header, the body's request_id field): 1 to 128 printable
# ASCII characters without spaces, so it can go into a header and a log line as it is. This module
# stays light (no pydantic model, no engine): Ray Serve's proxies import it at their start through
# cluster/serving/request_id_headers.py, and when the rule lived beside the request models it pulled
# torch and the whole server in -- ~4 s of a proxy's start on an idle box, past Serve's readiness
# checks (three of 5 s) on a busy one, which then killed the proxy and failed serve --ray's start.
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_PATTERN = r"^[!-~]+$"  # the field's (pydantic's regex: $ is the very end)
_ID_CHARS = re.compile(r"[!-~]+")  # the same, matched whole (Python's $ would let a trailing newline by)

REQUEST_ID_HEADER = "X-Request-Id"
_HEADER_KEY = REQUEST_ID_HEADER.lower().encode("latin-1")  # ASGI header names are lower-case bytes
_STATE_KEY = "request_id"  # the request's id in scope["state"] (``request.state.request_id``)
_CLIENTS_KEY = "request_id_is_clients"  # whether the client named it (header or body), in scope["state"]


def valid_request_id(value: object) -> bool:
    """Whether ``value`` may name a request (a str of 1 to MAX_REQUEST_ID_CHARS printable ASCII
    characters, no space): the request_id field's rule, for a header."""
    return isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_CHARS and _ID_CHARS.fullmatch(value) is not None


def request_id_of(scope: dict) -> str | None:
    """The id the answer to ``scope`` carries unless its route names an answer (None outside the
    middleware: a bare app in a test)."""
    return scope.get("state", {}).get(_STATE_KEY)


def new_request_id() -> str:
    """A fresh id (uuid4 hex), for a request the client did not name."""
    return uuid.uuid4().hex


def name_request(request: Request, request_id: str) -> None:
    """A route's word that the client named its request in the body (``request_id``, checked)."""
    request.state.request_id = request_id
    setattr(request.state, _CLIENTS_KEY, True)


def name_failed_answer(request: Request, answer_id: str | None) -> None:
    """A route's word, as an exception leaves it, that it had begun the answer ``answer_id`` (None:
    no answer began, the request failed or was refused before). The error answer and its log line
    then name that id, the one the request log names, unless the client named the request (its own
    id stays: the one it knows the request by)."""
    state = request.scope.get("state", {})
    if answer_id is not None and _STATE_KEY in state and not state.get(_CLIENTS_KEY):
        state[_STATE_KEY] = answer_id


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
        clients = given is not None and valid_request_id(given)
        # a dict of this request's own (the server may hand every request the same lifespan state),
        # shared by every copy of the scope made further in
        state = scope["state"] = {**scope.get("state", {}), _STATE_KEY: given if clients else new_request_id(),
                                  _CLIENTS_KEY: clients}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == _HEADER_KEY for k, _ in headers):
                    headers.append((_HEADER_KEY, state[_STATE_KEY].encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
