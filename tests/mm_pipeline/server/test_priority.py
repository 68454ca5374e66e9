"""vLLM's ``priority`` request field through the OpenAI server (the demo checkpoint, in process):
refused with a 400 naming the policy unless the server runs ``--queue-policy priority`` (as vLLM
answers), honoured there with the same greedy answer at any priority."""

from __future__ import annotations

import base64

import pytest

from tests.support.media_samples import image_bytes
from tests.support.paths import DEMO_MODEL
from tests.support.served import demo_engine_with, served_client

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

CHAT = {"messages": [{"role": "user", "content": "Name a shape."}], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def priority_engine():
    with demo_engine_with(queue_policy="priority") as engine:
        yield engine


@pytest.fixture(scope="module")
def priority_client(priority_engine, tmp_path_factory):
    with served_client(priority_engine, str(tmp_path_factory.mktemp("files"))) as c:
        yield c


def test_a_priority_under_fcfs_is_a_400_naming_the_policy(demo_client):
    r = demo_client.post("/v1/chat/completions", json={**CHAT, "priority": 3})
    assert r.status_code == 400 and "--queue-policy priority" in r.text, r.text
    r = demo_client.post("/v1/completions", json={"prompt": "A red", "max_tokens": 2, "priority": -1})
    assert r.status_code == 400 and "priority" in r.text, r.text
    assert demo_client.post("/v1/chat/completions", json={**CHAT, "priority": 0}).status_code == 200


@pytest.mark.parametrize("value", ["high", 1.5, 2**63])
def test_a_priority_that_is_not_an_int64_is_a_400(demo_client, value):
    r = demo_client.post("/v1/chat/completions", json={**CHAT, "priority": value})
    assert r.status_code == 400 and "priority" in r.text, r.text


def test_priorities_are_served_under_the_priority_policy(priority_client, demo_client):
    want = demo_client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    for rank in (-7, 0, 12):
        r = priority_client.post("/v1/chat/completions", json={**CHAT, "priority": rank, "n": 2})
        assert r.status_code == 200, r.text
        assert [c["message"]["content"] for c in r.json()["choices"]] == [want, want]
    r = priority_client.post("/v1/completions", json={"prompt": "A red", "max_tokens": 2, "priority": 5})
    assert r.status_code == 200, r.text


def test_the_priority_orders_the_encoder_jobs_too(priority_client, priority_engine):
    """A media request's encoder jobs carry its priority (the batcher takes them in that order)."""
    batcher = priority_engine.runtime.batcher
    seen: list[int] = []
    submit = batcher.submit

    def spy(job) -> None:
        seen.append(job.priority)
        submit(job)

    batcher.submit = spy
    try:
        url = "data:image/png;base64," + base64.b64encode(image_bytes("PNG", size=(72, 40))).decode()
        r = priority_client.post("/v1/chat/completions", json={**CHAT, "priority": -4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]})
        assert r.status_code == 200, r.text
    finally:
        del batcher.submit  # the class's method again
    assert seen == [-4]
