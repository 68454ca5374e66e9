"""SageMaker's serving contract, as vLLM serves it: ``/ping`` answers as ``/health`` (no API key), and
``POST /invocations`` takes a chat or a completion body and answers exactly as that route does,
streamed or not; a body that is neither is a 400."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import DEMO_MODEL
from tests.support.served import served_client

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

CHAT = {"messages": [{"role": "user", "content": "Name a shape."}], "max_tokens": 4, "temperature": 0}
TEXT = {"prompt": "A red square and", "max_tokens": 4, "temperature": 0}


def test_ping_is_health(demo_client):
    for method in ("GET", "POST"):
        r = demo_client.request(method, "/ping")
        assert r.status_code == 200 and r.json()["status"] == "ok"


def test_invocations_answer_as_the_chat_and_completion_routes(demo_client):
    chat = demo_client.post("/invocations", json=CHAT).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"] == demo_client.post("/v1/chat/completions", json=CHAT).json()["choices"]
    text = demo_client.post("/invocations", json=TEXT).json()
    assert text["object"] == "text_completion"
    assert text["choices"] == demo_client.post("/v1/completions", json=TEXT).json()["choices"]
    with demo_client.stream("POST", "/invocations", json={**CHAT, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("body, words", [({"input": "hi"}, "messages"), ([1, 2], "messages"),
                                         ({**CHAT, "temperature": 9}, "temperature")])
def test_a_body_that_is_neither_or_bad_is_a_400(demo_client, body, words):
    r = demo_client.post("/invocations", json=body)
    assert r.status_code == 400 and words in r.text, r.text


def test_ping_needs_no_key_and_invocations_do(demo_engine, tmp_path_factory):
    with served_client(demo_engine, str(tmp_path_factory.mktemp("f")), api_key="sk-x") as c:
        assert c.get("/ping").status_code == 200
        assert c.post("/invocations", json=TEXT).status_code == 401
        assert c.post("/invocations", json=TEXT, headers={"Authorization": "Bearer sk-x"}).status_code == 200
