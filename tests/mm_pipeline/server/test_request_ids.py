"""Request ids and request logs on the demo checkpoint: every answer names its id in ``X-Request-Id``
(the body's ``id``), a client's ``X-Request-Id`` header or vLLM's ``request_id`` field names the
answer (the header wins), two clients sending the same id are both served, a malformed id is a 400
naming it; ``--enable-log-requests`` writes one line per finished request (ids, tokens, times; no
text), and nothing without it."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.paths import DEMO_MODEL
from tests.support.served import served_client

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]
CHAT = {"messages": [{"role": "user", "content": "Describe a red square."}], "max_tokens": 6, "temperature": 0}


def test_every_answer_names_its_id_in_the_header(demo_client):
    r = demo_client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == r.json()["id"] and r.json()["id"].startswith("chatcmpl-")
    with demo_client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
        first = json.loads(next(line for line in s.iter_lines() if line.startswith("data: "))[6:])
        assert s.headers["X-Request-Id"] == first["id"]
    r = demo_client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert r.headers["X-Request-Id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    r = demo_client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 3})
    assert r.headers["X-Request-Id"] == r.json()["id"] and r.json()["id"].startswith("resp_")


def test_a_client_id_names_the_answer_and_the_header_wins(demo_client):
    r = demo_client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-7f3a"})
    assert r.json()["id"] == r.headers["X-Request-Id"] == "chatcmpl-trace-7f3a"
    r = demo_client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"})
    assert r.json()["id"] == "chatcmpl-from-body"
    r = demo_client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"},
                         headers={"X-Request-Id": "from-header"})
    assert r.json()["id"] == "chatcmpl-from-header"
    r = demo_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "c1"})
    assert r.json()["id"] == "cmpl-c1"


def test_the_same_id_from_two_clients_is_served_twice(demo_client):
    body = {**CHAT, "max_tokens": 40, "ignore_eos": True}

    def one(_: int):
        return demo_client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "same"})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(4)))
    assert all(r.status_code == 200 and r.json()["id"] == "chatcmpl-same" for r in answers), [r.text for r in answers]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in answers)


@pytest.mark.parametrize("headers, body", [({"X-Request-Id": "has space"}, {}), ({"X-Request-Id": "x" * 129}, {}),
                                           ({}, {"request_id": ""}), ({}, {"request_id": "tab\there"})])
def test_a_malformed_id_is_a_400_naming_it(demo_client, headers, body):
    r = demo_client.post("/v1/chat/completions", json={**CHAT, **body}, headers=headers)
    assert r.status_code == 400, r.text
    named = r.json()["error"]["param"] or r.json()["error"]["message"]
    assert ("X-Request-Id" if headers else "request_id") in named


def test_enable_log_requests_writes_a_line_per_request(demo_engine, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mmserve.requests"):
        with served_client(demo_engine, str(tmp_path / "a")) as quiet:
            quiet.post("/v1/chat/completions", json=CHAT)
        assert not [r for r in caplog.records if r.name == "mmserve.requests"]
        with served_client(demo_engine, str(tmp_path / "b"), log_requests=True) as client:
            r = client.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers={"X-Request-Id": "logged"})
            usage = r.json()["usage"]
    lines = [r.getMessage() for r in caplog.records if r.name == "mmserve.requests"]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("chatcmpl-logged: ") and "n 2" in line and "TTFT" in line
    assert f"prompt {usage['prompt_tokens']} tokens" in line and f"completion {usage['completion_tokens']} tokens" in line
    assert "red square" not in line  # no text of the request


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=140)
       | st.text(alphabet=st.sampled_from("ab~!\n\r\t \x7f\x00"), max_size=8)
       | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=120, max_size=140))
def test_the_light_request_id_rule_agrees_with_the_request_id_field(value):
    """request_id.valid_request_id (no pydantic, no server: Ray's proxies import it) gives the
    verdict of the body's ``request_id`` field on every string -- a trailing newline included, which
    Python's ``$`` would have let by."""
    from pydantic import TypeAdapter, ValidationError

    from mm_pipeline.server.completions.sampling_fields import RequestId
    from mm_pipeline.server.request_id import valid_request_id

    try:
        TypeAdapter(RequestId).validate_python(value)
        field = True
    except ValidationError:
        field = False
    assert valid_request_id(value) == field
