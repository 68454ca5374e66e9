"""Every error kind reaches the client as its HTTP status, by type, through the HTTP app.

A scripted engine (no model) raises each typed error, or ends a request with each engine error
kind, so the whole table is checked in milliseconds; every scripted message impersonates another
kind, which proves the status comes from the type alone. The same answers from real causes, through
a tiny real engine: test_error_causes.py.
"""

from __future__ import annotations

import ast
import inspect
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

import mm_pipeline.errors as errors
from llm_core.engine.outputs import ErrorKind
from mm_pipeline.errors import (ContextLengthError, InternalError, InvalidInputError, InvalidMediaError,
                                InvalidMessageError, MediaAccessDenied, MediaError, MediaFetchError, MediaFetchTimeout,
                                MediaNotFound, MediaTooLarge, MMServeError, OverloadedError, ServerBusy,
                                UndecodableMediaError, UnsupportedMediaType, generation_error)
from mm_pipeline.runtime.omni_engine import GenerationDelta
from mm_pipeline.server import ServerSettings, create_app
from mm_pipeline.server.errors import INTERNAL_MESSAGE, STATUS_OF, http_answer, to_api_error


# Each scripted error says something that, read as text, would point at another kind.
DECOY = "RuntimeError: prompt of 9000 tokens exceeds the context limit; 429 rate limited; file not found"


# ---- the table, through the app with a scripted engine -------------------------------------------
class ScriptedEngine:
    """The OmniEngine API without a model: a request raises ``raises`` before its first delta, or
    streams one token and ends with ``ends`` = (finish_reason, error_kind)."""

    model_name = "scripted"
    tokenizer = None

    def __init__(self) -> None:
        self.raises: BaseException | None = None
        self.ends: tuple[str, str | None] = ("length", None)

    async def generate(self, messages: list[dict], params: Any, *, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None
                       ) -> AsyncIterator[GenerationDelta]:
        async for delta in self._script(request_id or "r"):
            yield delta

    async def generate_prompt(self, prompt: Any, params: Any, *, request_id: str | None = None,
                              priority: int = 0, cache_salt: str | None = None
                              ) -> AsyncIterator[GenerationDelta]:
        async for delta in self._script(request_id or "r"):
            yield delta

    async def _script(self, rid: str) -> AsyncIterator[GenerationDelta]:
        if self.raises is not None:
            raise self.raises
        yield GenerationDelta(rid, [7], "a", None, None, False, None, 3, 1, 0, time.time())
        reason, kind = self.ends
        yield GenerationDelta(rid, [], "", None, None, True, reason, 3, 1, 0, time.time(),
                              error=DECOY if reason == "error" else None, error_kind=kind)

    def stats(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    engine = ScriptedEngine()
    app = create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files"))))
    # the app answers a stray exception with 500, then re-raises it for the server to log
    with TestClient(app, raise_server_exceptions=False) as client:
        client.engine = engine
        yield client


CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

#  raised before the first delta            status  OpenAI type               code                      kind
RAISED = [
    (InvalidMessageError,                    400, "invalid_request_error", None,                     "invalid_input"),
    (InvalidInputError,                      400, "invalid_request_error", None,                     "invalid_input"),
    (ContextLengthError,                     400, "invalid_request_error", "context_length_exceeded", "context_length"),
    (MediaError,                             400, "invalid_request_error", None,                     "media"),
    (InvalidMediaError,                      400, "invalid_request_error", None,                     "media"),
    (UndecodableMediaError,                  400, "invalid_request_error", None,                     "media"),
    (MediaFetchError,                        400, "invalid_request_error", None,                     "media"),
    (MediaAccessDenied,                      403, "permission_error",      None,                     "media"),
    (MediaNotFound,                          404, "not_found_error",       None,                     "media"),
    (MediaFetchTimeout,                      408, "timeout_error",         None,                     "media"),
    (MediaTooLarge,                          413, "request_too_large",     None,                     "media"),
    (UnsupportedMediaType,                   415, "unsupported_media_type", None,                    "media"),
    (OverloadedError,                        429, "rate_limit_error",      None,                     "overloaded"),
    (ServerBusy,                             503, "service_unavailable",   None,                     "overloaded"),
    (InternalError,                          500, "server_error",          None,                     "internal"),
]

#  how the engine ended the request          status  code                       kind
ENDED = [
    (("error", ErrorKind.INVALID_INPUT),     400, None,                      "invalid_input"),
    (("error", ErrorKind.CONTEXT_LENGTH),    400, "context_length_exceeded", "context_length"),
    (("error", ErrorKind.INTERNAL),          500, None,                      "internal"),
    (("error", None),                        500, None,                      "internal"),  # unknown: not the caller's fault
    (("abort", None),                        503, None,                      "overloaded"),  # shut down under it: retry
]


def _sse_events(text: str) -> list[Any]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(("error_type", "status", "openai_type", "code", "kind"), RAISED,
                         ids=[r[0].__name__ for r in RAISED])
def test_a_raised_error_is_answered_by_its_type(scripted, error_type, status, openai_type, code, kind):
    scripted.engine.raises, scripted.engine.ends = error_type(DECOY), ("length", None)
    for body in (CHAT, {**CHAT, "stream": True}):  # a stream fails before its first byte: same answer
        r = scripted.post("/v1/chat/completions", json=body)
        assert r.status_code == status
        message = INTERNAL_MESSAGE if status == 500 else DECOY  # an internal error's text stays in the log
        assert r.json() == {"error": {"message": message, "type": openai_type, "param": None, "code": code,
                                      "kind": kind}}
        retry = r.headers.get("retry-after")
        assert (retry is not None and int(retry) >= 1) == (kind == "overloaded")


def test_an_unknown_exception_is_500_without_its_message(scripted):
    scripted.engine.raises = RuntimeError("secret internals")
    r = scripted.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal server error (RuntimeError)", "type": "server_error",
                                 "param": None, "code": None, "kind": "internal"}


@pytest.mark.parametrize(("ends", "status", "code", "kind"), ENDED, ids=[f"{e[0]}-{e[1]}" for e, *_ in ENDED])
def test_an_engine_failure_is_answered_by_its_kind(scripted, ends, status, code, kind):
    scripted.engine.raises, scripted.engine.ends = None, ends
    r = scripted.post("/v1/completions", json={"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 4})
    assert r.status_code == status
    assert r.json()["error"]["code"] == code and r.json()["error"]["kind"] == kind
    assert ("retry-after" in r.headers) == (kind == "overloaded")
    # streamed, the token went out already: the failure is one event carrying the same body
    for url, body in (("/v1/completions", {"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 4}),
                      ("/v1/chat/completions", CHAT)):
        r = scripted.post(url, json={**body, "stream": True})
        assert r.status_code == 200
        events = _sse_events(r.text)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        error = events[-2]["error"]
        assert (error["code"], error["kind"]) == (code, kind)
        assert error["type"] == {400: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}[status]


@pytest.mark.parametrize(("ends", "status", "code", "kind"), ENDED, ids=[f"{e[0]}-{e[1]}" for e, *_ in ENDED])
def test_a_failed_response_is_its_status_or_error_and_failed_events(scripted, ends, status, code, kind):
    """/v1/responses: the same status not streamed; streamed (the first token went out), an ``error``
    event with the same code, then ``response.failed`` carrying it, and the response is not stored."""
    scripted.engine.raises, scripted.engine.ends = None, ends
    body = {"model": "scripted", "input": "hi", "max_output_tokens": 4}
    r = scripted.post("/v1/responses", json=body)
    assert r.status_code == status and r.json()["error"]["kind"] == kind
    r = scripted.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200
    events = _sse_events(r.text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == (code or kind) and events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": code or kind, "message": events[-2]["message"]}
    assert scripted.get(f"/v1/responses/{failed['id']}").status_code == 404


def test_a_body_that_does_not_validate_is_invalid_input(scripted):
    r = scripted.post("/v1/chat/completions", json={"model": "scripted", "messages": "hi", "temperature": 9})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["kind"] == "invalid_input"


def test_a_request_that_ends_well_has_no_error(scripted):
    scripted.engine.raises, scripted.engine.ends = None, ("length", None)
    r = scripted.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


# ---- classification never reads a message --------------------------------------------------------
def test_every_error_type_and_engine_kind_has_an_answer():
    types = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, MMServeError)]
    assert {t for t, *_ in RAISED} | {MMServeError} == set(types)  # the table above covers every type
    for t in types:
        assert http_answer(t).status in (400, 403, 404, 408, 413, 415, 429, 500, 503)
        assert isinstance(t.kind, str)
    assert set(STATUS_OF) <= set(types)
    for kind in ErrorKind:  # every kind the text engine reports comes back as a type of that kind
        error = generation_error("error", kind, "m")
        assert error is not None and error.kind == kind.value


def test_the_answer_comes_from_the_type_and_never_from_the_message():
    assert list(inspect.signature(http_answer).parameters) == ["error_type"]  # a type in, no text
    messages = ["", DECOY, "prompt of 5 tokens leaves no room", "KeyError: x", "rate limited, retry"]
    for error_type, *_ in RAISED:
        answers = {(e.status, e.code, e.kind) for e in (to_api_error(error_type(m)) for m in messages)}
        assert answers == {(http_answer(error_type).status, http_answer(error_type).code, error_type.kind)}


def test_the_same_message_under_different_kinds_gets_different_answers():
    answers = {kind: http_answer(type(generation_error("error", kind, DECOY))) for kind in ErrorKind}
    assert answers[ErrorKind.INVALID_INPUT].status == 400 and answers[ErrorKind.INVALID_INPUT].code is None
    assert answers[ErrorKind.CONTEXT_LENGTH].code == "context_length_exceeded"
    assert answers[ErrorKind.INTERNAL].status == 500
    assert generation_error("length", None, DECOY) is None and generation_error("stop", "internal", DECOY) is None
    with pytest.raises(TypeError):
        http_answer(ValueError)  # type: ignore[arg-type]  # only the pipeline's own types have an answer


@pytest.mark.parametrize("module", ["mm_pipeline/errors.py", "mm_pipeline/server/errors.py",
                                    "mm_pipeline/server/completions/chat_service.py",
                                    "mm_pipeline/server/completions/choices.py",
                                    "mm_pipeline/jobs/caption.py", "mm_pipeline/jobs/batch.py",
                                    "mm_pipeline/server/batches/lines.py"])
def test_error_classification_code_has_no_regex(module):
    tree = ast.parse((Path(__file__).parents[3] / module).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "re" not in imported and "fnmatch" not in imported


@pytest.mark.parametrize("part, param", [
    ({"type": "file", "file": {}}, "messages.0.content.0.file"),
    ({"type": "image_url", "image_url": {"url": 5}}, "messages.0.content.0.image_url.url"),
    ({"type": "text", "text": 5}, "messages.0.content.0.text"),
    ({"type": "image_url", "image_url": {"url": "data:,", "detail": "bogus"}}, "messages.0.content.0.image_url.detail"),
])
def test_a_part_that_does_not_validate_is_named_once(scripted, part, param):
    """Pydantic's tagged union names a part's tag and then its field of the same name
    (content.0.file.file); the client wrote it once."""
    r = scripted.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(param + ":"), r.text


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(scripted):
    """RFC 9110: a 405 carries Allow (Starlette's header was dropped when the error was rebuilt)."""
    r = scripted.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["type"] == "invalid_request_error"
