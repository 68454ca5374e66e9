"""Every error kind reaches the client as its HTTP status, by type, through the HTTP app.

Two halves. A scripted engine (no model) raises each typed error, or ends a request with each
engine error kind, so the whole table is checked in milliseconds; every scripted message
impersonates another kind, which proves the status comes from the type alone. Then a tiny real
engine shows the same answers arising from real causes: a prompt over the context limit, broken
media, a path outside the allowed directories, a full admission queue, and an exception injected
into a model step (500 while a concurrent request is still served).
"""

from __future__ import annotations

import ast
import asyncio
import base64
import inspect
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
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

from tests.support.paths import SAMPLE_MEDIA as MEDIA
from tests.support.served import served_tiny_omni

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


# ---- the same answers from real causes (tiny omni engine on CPU) ---------------------------------
POISON = [301, 302, 303, 304, 305, 306]  # a prompt whose prefill step is made to raise (last test)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # one running request at a time: a step that raises then holds only the request that caused it
    with served_tiny_omni(tmp_path_factory, num_full_tokens=2048, num_swa_tokens=1024, max_num_seqs=1,
                          max_queue=2, max_model_len=256, allowed_local_dirs=(str(MEDIA),)) as server:
        yield server


def _post(served, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(served.base_url + path, json={"model": served.engine.model_name, **body}, timeout=60, **kw)


def _image(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what?"}]}], "max_tokens": 2}


def _data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def _wait_in_flight(engine, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.requests_in_flight != n:
        assert time.monotonic() < deadline, f"in_flight never reached {n}: {engine.requests_in_flight}"
        time.sleep(0.02)


@pytest.mark.parametrize(("body", "status", "code", "kind"), [
    ({"prompt": [3] * 300, "max_tokens": 2}, 400, "context_length_exceeded", "context_length"),
    ({"prompt": [3, 4, 9999], "max_tokens": 2}, 400, None, "invalid_input"),  # id outside the vocabulary
    (_image(_data_url(b"\x89PNG\r\n\x1a\nbroken")), 400, None, "media"),
    (_image("file:///etc/passwd"), 403, None, "media"),
    (_image(str(MEDIA / "no-such-image.png")), 404, None, "media"),
    (_image(_data_url(b"plain text, not an image at all " * 8)), 415, None, "media"),
], ids=["too-long", "bad-token-id", "broken-media", "forbidden-path", "missing-file", "not-an-image"])
def test_real_causes_get_their_status(served, body, status, code, kind):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = _post(served, path, body)
    assert r.status_code == status, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["kind"]) == (code, kind)


@pytest.mark.parametrize("route", ["chat", "responses"])
@pytest.mark.parametrize("items", [1, 2], ids=["one-item", "two-items"])
@pytest.mark.parametrize("when", ["planned", "decoded"])
def test_a_media_error_names_the_part_its_item_came_from(served, route, items, when):
    """In the message and in ``param``, as a refused part is named: a client of several images
    learns which one failed, whether its header is refused while it is planned or its pixels
    while they are decoded (one item takes the one-hop prepare, two the usual path). The
    Responses API names its own input item."""
    from tests.support.media_samples import image_bytes

    good = _data_url(image_bytes(size=(32, 32)))
    png = image_bytes(size=(96, 96))  # a valid header, then pixels cut short: fails in the decode
    broken = _data_url(b"\x89PNG\r\n\x1a\nbroken" if when == "planned" else png[:len(png) // 2])
    if route == "chat":
        parts = [{"type": "text", "text": "what?"}] + [{"type": "image_url", "image_url": {"url": good}}] * (items - 1)
        r = _post(served, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [*parts, {"type": "image_url", "image_url": {"url": broken}}]}]})
        where, param = f"messages[2].content[{items}]", f"messages.2.content.{items}"
    else:
        parts = [{"type": "input_text", "text": "what?"}] + [{"type": "input_image", "image_url": good}] * (items - 1)
        r = _post(served, "/v1/responses", {"max_output_tokens": 2, "instructions": "Be brief.", "input": [
            {"role": "user", "content": "Hi"}, {"role": "user", "content": [
                *parts, {"type": "input_image", "image_url": broken}]}]})
        where, param = f"input[1].content[{items}]", f"input.1.content.{items}"
    error = r.json()["error"]
    assert r.status_code == 400 and error["kind"] == "media" and error["param"] == param, r.text
    said = "image from data-url cannot be read" if when == "planned" else "png image from data-url is damaged"
    assert error["message"] == f"{where}: {said}", r.text  # PIL's own words stay in the log


def test_a_too_long_prompt_streamed_is_a_400_before_the_stream_starts(served):
    """The engine rejects it before any token: the status can still say so (no 200 + error event)."""
    r = _post(served, "/v1/completions", {"prompt": [3] * 300, "max_tokens": 2, "stream": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["kind"] == "context_length"


def test_a_full_queue_is_429_with_retry_after(served):
    text_model = served.engine.runtime.model.text
    forward, entered, gate = text_model.forward, threading.Event(), threading.Event()

    def gated(*args, **kwargs):  # model steps wait for the gate: nothing finishes while we look
        entered.set()
        gate.wait(60)
        return forward(*args, **kwargs)

    text_model.forward = gated
    pool = ThreadPoolExecutor(2)
    try:
        first = pool.submit(_post, served, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        assert entered.wait(30)  # the first request is inside a model step
        second = pool.submit(_post, served, "/v1/completions", {"prompt": [8, 9], "max_tokens": 2})
        _wait_in_flight(served.engine, 2)  # admitted behind it: the queue (max_queue 2) is full
        r = _post(served, "/v1/completions", {"prompt": [10, 11], "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["kind"] == "overloaded"
        gate.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
    finally:
        gate.set()
        pool.shutdown(wait=True)
        del text_model.forward


def _contains(ids: list[int], run: list[int]) -> bool:
    return any(ids[i:i + len(run)] == run for i in range(len(ids) - len(run) + 1))


def test_a_model_step_that_raises_is_500_and_a_concurrent_request_is_served(served):
    text_model = served.engine.runtime.model.text
    forward = text_model.forward

    def poisoned(input_ids, *args, **kwargs):
        if input_ids is not None and _contains(input_ids.tolist(), POISON):
            raise RuntimeError("injected device failure")
        return forward(input_ids, *args, **kwargs)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=60) as http:
            model = served.engine.model_name
            return list(await asyncio.gather(
                http.post("/v1/completions", json={"model": model, "prompt": POISON, "max_tokens": 4}),
                http.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8,
                                                   "ignore_eos": True, "temperature": 0})))

    text_model.forward = poisoned
    try:
        bad, good = asyncio.run(both())
    finally:
        del text_model.forward
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["kind"] == "internal" and error["type"] == "server_error"
    assert "injected device failure" not in error["message"]  # the server log has it, the client does not
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    again = _post(served, "/v1/completions", {"prompt": POISON, "max_tokens": 2})
    assert again.status_code == 200  # the engine kept serving; the same prompt works without the fault


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
