"""Every HTTP answer carries ``X-Request-Id`` (request_id.py), not only a completion: an error above
all, so a proxy or a client can match it with the server's log line. The answer's id where an answer
was made (unchanged), else the client's own id (a valid header, or the body's ``request_id``), else the
answer's id where the answer began and then failed (as the request log names it), else a fresh one; an
invalid client id is never echoed. A scripted engine (no model) behind the whole app."""

from __future__ import annotations

import logging
import re

import pytest
from fastapi.testclient import TestClient

from llm_core.engine.outputs import ErrorKind
from mm_pipeline.errors import ContextLengthError
from mm_pipeline.server import ServerSettings, create_app
from tests.mm_pipeline.server.test_error_statuses import ScriptedEngine
from tests.support.paths import SAMPLE_MEDIA

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PROMPT = {"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 4}
RESPONSE = {"model": "scripted", "input": "hi", "max_output_tokens": 4}
CLIP = SAMPLE_MEDIA / "audio_000003.wav"  # a transcription's upload (the scripted engine hears nothing)


def valid_request_id(value: str) -> bool:
    """What a client may send as its id (sampling_fields.RequestId), so a fresh one is one too."""
    return re.fullmatch(r"[!-~]{1,128}", value) is not None


def served(tmp_path, **settings) -> TestClient:
    app = create_app(ScriptedEngine(), ServerSettings(files_dir=str(tmp_path), model_name="scripted", **settings))
    return TestClient(app, raise_server_exceptions=False)  # a bug's 500 is the app's answer, not the test's


@pytest.fixture
def client(tmp_path):
    with served(tmp_path) as c:
        yield c


def fails(client: TestClient, error: BaseException | None) -> None:
    client.app.state.engine.raises = error


def test_an_error_answer_echoes_the_clients_id(client):
    fails(client, ContextLengthError("prompt of 9000 tokens is over the 4096-token context"))
    for url, body in (("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "stream": True}),
                      ("/v1/completions", PROMPT), ("/invocations", CHAT)):
        r = client.post(url, json=body, headers={"X-Request-Id": "trace-7f3a"})
        assert r.status_code == 400 and r.headers["X-Request-Id"] == "trace-7f3a", (url, r.headers)
    # vLLM's request_id field names the request too; the header wins over it, as for the answer's id
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"})
    assert r.status_code == 400 and r.headers["X-Request-Id"] == "from-body"
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"},
                    headers={"X-Request-Id": "from-header"})
    assert r.headers["X-Request-Id"] == "from-header"


def test_the_answers_id_names_an_answer_and_the_clients_id_an_error(client):
    fails(client, None)  # answered: as before, the answer's id (the client's inside it)
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "same"})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == r.json()["id"] == "chatcmpl-same"
    r = client.post("/v1/completions", json=PROMPT)
    assert r.headers["X-Request-Id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                       headers={"X-Request-Id": "same"}) as s:
        assert s.status_code == 200 and s.headers["X-Request-Id"] == "chatcmpl-same"
    r = client.post("/v1/responses", json={"model": "scripted", "input": "hi", "max_output_tokens": 4},
                    headers={"X-Request-Id": "same"})
    assert r.headers["X-Request-Id"] == r.json()["id"] and r.json()["id"].startswith("resp_")
    fails(client, ContextLengthError("too long"))  # no answer made: the client's id as it sent it
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "same"})
    assert r.status_code == 400 and r.headers["X-Request-Id"] == "same"


def test_an_error_without_a_client_id_gets_a_fresh_one(client):
    fails(client, ContextLengthError("too long"))
    ids = []
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 400
        ids.append(r.headers["X-Request-Id"])
    r = client.post("/v1/chat/completions", json={"model": "scripted", "messages": "hi", "temperature": 9})
    assert r.status_code == 400 and r.json()["error"]["kind"] == "invalid_input"  # FastAPI's 422, ours 400
    ids.append(r.headers["X-Request-Id"])
    fails(client, RuntimeError("a bug"))  # answered 500 by the outer middleware, not a handler
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    ids.append(r.headers["X-Request-Id"])
    assert all(valid_request_id(i) for i in ids) and len(set(ids)) == len(ids), ids


@pytest.mark.parametrize(("method", "url", "status"), [
    ("GET", "/health", 200), ("GET", "/ping", 200), ("GET", "/metrics", 200), ("GET", "/v1/models", 200),
    ("GET", "/v1/models/nope", 404), ("GET", "/v1/files/file-nope", 404), ("GET", "/no/such/route", 404),
    ("DELETE", "/v1/chat/completions", 405), ("GET", "/v1/responses/resp_nope", 404)])
def test_every_route_names_the_request(client, method, url, status):
    r = client.request(method, url)
    assert r.status_code == status and valid_request_id(r.headers["X-Request-Id"])
    r = client.request(method, url, headers={"X-Request-Id": "probe-1"})
    assert r.status_code == status and r.headers["X-Request-Id"] == "probe-1"


@pytest.mark.parametrize("bad", ["has space", "x" * 129, "tab\there", "caf\u00e9"])
def test_an_invalid_client_id_is_not_echoed(client, bad):
    fails(client, None)
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad.encode("utf-8")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"  # as before
    sent = r.headers["X-Request-Id"]
    assert sent != bad and bad not in sent and valid_request_id(sent)
    r = client.get("/health", headers={"X-Request-Id": bad.encode("utf-8")})  # a route that takes no id: served
    assert r.status_code == 200 and r.headers["X-Request-Id"] != bad and valid_request_id(r.headers["X-Request-Id"])


def test_limits_the_key_and_cors_preflights_name_the_request(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mmserve.server")
    origin = "https://app.example.com"
    with served(tmp_path, api_key="sk-1", max_request_bytes=1024, allowed_origins=(origin,)) as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "no-key"})
        assert r.status_code == 401 and r.headers["X-Request-Id"] == "no-key"
        assert any(rec.getMessage().startswith("no-key: POST ") for rec in caplog.records)  # the key check's own line
        r = c.post("/v1/chat/completions", json={**CHAT, "padding": "x" * 2000},
                   headers={"Authorization": "Bearer sk-1", "X-Request-Id": "too-big"})
        assert r.status_code == 413 and r.headers["X-Request-Id"] == "too-big"
        pre = c.options("/v1/chat/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and valid_request_id(pre.headers["X-Request-Id"])
        r = c.get("/health", headers={"Origin": origin})  # and the page may read it
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower() and r.headers["X-Request-Id"]


def test_the_error_log_line_names_the_answers_request_id(client, caplog):
    caplog.set_level(logging.INFO, logger="mmserve.server")
    fails(client, ContextLengthError("too long"))
    named = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-log"})
    fresh = client.get("/v1/models/nope")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "mmserve.server"]
    assert named.headers["X-Request-Id"] == "trace-log"
    assert [line.split(": ", 1)[0] for line in lines] == ["trace-log", fresh.headers["X-Request-Id"]], lines
    assert "'/v1/chat/completions' -> 400" in lines[0] and "'/v1/models/nope' -> 404" in lines[1]


class FailsMidway(ScriptedEngine):
    """One token, then a bug raises out of the request's stream (no handler takes it: a 500)."""

    async def _script(self, rid: str):
        async for delta in super()._script(rid):
            yield delta
            raise RuntimeError("a bug after the first token")


@pytest.mark.parametrize(("url", "sent", "answer"), [
    ("/v1/chat/completions", {"json": CHAT}, "chatcmpl-"), ("/v1/completions", {"json": PROMPT}, "cmpl-"),
    ("/invocations", {"json": CHAT}, "chatcmpl-"), ("/v1/responses", {"json": RESPONSE}, "resp_"),
    ("/v1/audio/transcriptions", {"files": {"file": (CLIP.name, CLIP.read_bytes())}, "data": {"model": "scripted"}},
     "chatcmpl-")], ids=["chat", "completions", "invocations", "responses", "transcriptions"])
def test_an_answer_that_fails_after_it_began_names_its_own_id(tmp_path, caplog, url, sent, answer):
    """The route had named the answer (the request log names it) when the engine failed: a client
    that sent no id reads that id in the error's header, and the error's log line names it too."""
    caplog.set_level(logging.INFO, logger="mmserve")
    for engine, ends, status in ((ScriptedEngine(), ("error", ErrorKind.INTERNAL), 500),
                                 (ScriptedEngine(), ("abort", None), 503),
                                 (ScriptedEngine(), ("error", ErrorKind.INVALID_INPUT), 400),
                                 (FailsMidway(), ("length", None), 500)):
        engine.ends = ends
        caplog.clear()
        app = create_app(engine, ServerSettings(files_dir=str(tmp_path), model_name="scripted", log_requests=True))
        with TestClient(app, raise_server_exceptions=False) as c:
            r = c.post(url, **sent)
        rid = r.headers["X-Request-Id"]
        assert r.status_code == status and rid.startswith(answer) and valid_request_id(rid), (ends, r.headers)
        errors = [rec.getMessage() for rec in caplog.records if rec.name == "mmserve.server"]
        assert [line.split(": ", 1)[0] for line in errors if " -> " in line] == [rid], errors
        if answer != "resp_":  # a response's chat is logged by the chat's own id
            ended = [rec.getMessage() for rec in caplog.records if rec.name == "mmserve.requests"]
            assert [line.split(": ", 1)[0] for line in ended] == [rid], ended


def test_a_failed_answer_keeps_the_clients_id_and_a_refused_one_has_no_answer_id(client):
    fails(client, None)
    client.app.state.engine.ends = ("error", ErrorKind.INTERNAL)  # failed after the answer began
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-9"})
    assert r.status_code == 500 and r.headers["X-Request-Id"] == "trace-9"  # as the client named it
    r = client.post("/v1/completions", json={**PROMPT, "request_id": "from-body"})
    assert r.status_code == 500 and r.headers["X-Request-Id"] == "from-body"
    r = client.post("/v1/responses", json=RESPONSE, headers={"X-Request-Id": "trace-9"})
    assert r.status_code == 500 and r.headers["X-Request-Id"] == "trace-9"
    fails(client, ContextLengthError("too long"))  # refused at its start: no answer began, a fresh id
    for url, body in (("/v1/chat/completions", CHAT), ("/v1/completions", PROMPT), ("/v1/responses", RESPONSE)):
        r = client.post(url, json=body)
        assert r.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-Id"]), (url, r.headers)
