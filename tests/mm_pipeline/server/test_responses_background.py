"""OpenAI's Responses API (``/v1/responses``) in background mode, on test_reasoning_server.py's
scripted engine (a slow scripted engine that counts its open generations): the answer polled is the
foreground one, a cancel aborts the engine requests (none left open), a shutdown too, the limit is
a 429, an answer larger than the store is failed (not lost), and the combinations it cannot serve
are 400s naming them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from mm_pipeline.errors import ContextLengthError, OverloadedError
from mm_pipeline.server import ServerSettings, ServerThread, create_app
from tests.mm_pipeline.server.test_reasoning_server import GENERATION_PROMPT, THINKS, ThinkingEngine
from tests.mm_pipeline.server.test_tool_calls_server import CALLS
from tests.support.responses_api import GREEDY, TOOLS, ThinkingEngine_for, demo_tokenizer, message_text, without_ids


# ---- background mode (scripted engines) -------------------------------------------------------------------
LONG = ["word "] * 2000  # ~20 s at SlowEngine(delay=0.01): it runs until cancelled


class SlowEngine(ThinkingEngine):
    """ThinkingEngine writing a delta every ``delay`` s, counting the generations it holds open (each
    an engine slot until its stream is closed) and those closed before their last delta (aborted).
    ``refuse``: errors its next generations raise before their first delta (no room, a bad prompt)."""

    def __init__(self, scripts: list[list[str]], delay: float = 0.0, refuse: list[Exception] = ()) -> None:
        tok = demo_tokenizer()
        super().__init__(tok, scripts, GENERATION_PROMPT, tok)
        self.delay, self.refuse = delay, list(refuse)
        self.in_flight, self.started, self.aborted = 0, [], []

    async def generate(self, messages: Any, params: Any, *, request_id: str = "r-0", priority: int = 0,
                       cache_salt: str | None = None):
        if self.refuse:
            raise self.refuse.pop(0)
        self.in_flight += 1
        self.started.append(request_id)
        ended = False
        try:
            async for delta in super().generate(messages, params, request_id=request_id):
                await asyncio.sleep(self.delay)
                ended = delta.finished
                yield delta
        finally:
            self.in_flight -= 1
            if not ended:
                self.aborted.append(request_id)


def serve(engine: ThinkingEngine, tmp_path, **settings) -> ServerThread:
    return ServerThread(create_app(engine, ServerSettings(files_dir=str(tmp_path), **settings)))


def sdk(base: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def polled(base: str, response_id: str, until=lambda r: r["status"] not in ("queued", "in_progress"),
           timeout_s: float = 10) -> dict:
    """GET the response until ``until`` holds of it (by default: until it has ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{base}/v1/responses/{response_id}", timeout=30)
        assert r.status_code == 200, r.text
        if until(r.json()):
            return r.json()
        assert time.monotonic() < deadline, f"still {r.json()['status']}"
        time.sleep(0.01)


def started(base: str, engine: SlowEngine, **fields) -> str:
    """A background response of ``fields``, once its generation runs in the engine: its id."""
    r = httpx.post(base + "/v1/responses", json={"input": "Talk.", "background": True, **fields}, timeout=30)
    assert r.status_code == 200, r.text
    polled(base, r.json()["id"], until=lambda got: got["status"] == "in_progress" and engine.in_flight == 1)
    return r.json()["id"]


JSON_OBJECT = {"text": {"format": {"type": "json_object"}}, "top_logprobs": 2}


@pytest.mark.parametrize("script, fields", [(THINKS, JSON_OBJECT), (CALLS, {"tools": TOOLS})])
def test_a_background_response_is_the_foreground_one(tmp_path, script, fields):
    engine = SlowEngine([script])
    with serve(engine, tmp_path) as server:
        body = {**GREEDY, "input": "Weather in Paris and Rome?", "metadata": {"run": "1"}, **fields}
        want = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30).json()
        client = sdk(server.base_url)
        created = client.responses.create(model="thinker", background=True, **body)
        assert created.background and created.status in ("queued", "in_progress") and not created.output
        # the POST's connection is closed: the answer goes on without it
        while (got := client.responses.retrieve(created.id)).status in ("queued", "in_progress"):
            time.sleep(0.01)
        assert got.status == "completed" and got.output_text == message_text(want)
        final = httpx.get(f"{server.base_url}/v1/responses/{created.id}", timeout=30).json()
        same = lambda r: {k: v for k, v in r.items()  # noqa: E731
                          if k not in ("id", "created_at", "output", "background")}
        assert same(final) == same(want) and without_ids(final["output"]) == without_ids(want["output"])
        assert final["background"] and not want["background"] and final["usage"]["output_tokens"] > 0
        (item,) = client.responses.input_items.list(created.id).data
        assert item.content[0].text == "Weather in Paris and Rome?"
        # and it is continued like any stored response
        follow = httpx.post(server.base_url + "/v1/responses",
                            json={"input": "Thanks.", "previous_response_id": created.id}, timeout=30)
        assert follow.status_code == 200, follow.text
        assert engine.in_flight == 0 and not engine.aborted


def test_cancelling_a_running_background_response_aborts_its_engine_requests(tmp_path):
    engine = SlowEngine([LONG], delay=0.01)
    with serve(engine, tmp_path) as server:
        base, client = server.base_url, sdk(server.base_url)
        rid = started(base, engine, metadata={"run": "1"})
        # while it runs: found, listed, not continued
        assert client.responses.retrieve(rid).status == "in_progress"
        assert len(client.responses.input_items.list(rid).data) == 1
        r = httpx.post(base + "/v1/responses", json={"input": "And?", "previous_response_id": rid}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        assert "in_progress" in r.json()["error"]["message"]
        began = time.monotonic()
        cancelled = client.responses.cancel(rid)
        assert cancelled.status == "cancelled" and cancelled.background and time.monotonic() - began < 5
        assert engine.in_flight == 0 and engine.aborted == engine.started and len(engine.started) == 1
        assert len(server.server.config.app.state.background_responses) == 0
        # ended: stored as cancelled; a second cancel returns it as it is; it has no answer to continue
        stored = httpx.get(f"{base}/v1/responses/{rid}", timeout=30).json()
        assert stored["status"] == "cancelled" and stored["metadata"] == {"run": "1"}
        assert client.responses.cancel(rid).model_dump(mode="json") == client.responses.retrieve(rid).model_dump(
            mode="json")
        r = httpx.post(base + "/v1/responses", json={"input": "And?", "previous_response_id": rid}, timeout=30)
        assert r.status_code == 400 and "cancelled" in r.json()["error"]["message"]
        # DELETE of a running one stops it too
        rid = started(base, engine)
        assert httpx.delete(f"{base}/v1/responses/{rid}", timeout=30).json()["deleted"] is True
        assert engine.in_flight == 0 and engine.aborted == engine.started and len(engine.started) == 2
        assert httpx.get(f"{base}/v1/responses/{rid}", timeout=30).status_code == 404


def test_cancelling_a_finished_or_foreground_response(scripted):
    base = scripted([["Fine."]])
    r = httpx.post(base + "/v1/responses", json={"input": "Hi", "background": True}, timeout=30)
    done = polled(base, r.json()["id"])
    assert done["status"] == "completed" and message_text(done) == "Fine."
    again = httpx.post(f"{base}/v1/responses/{done['id']}/cancel", timeout=30)
    assert again.status_code == 200 and again.json() == done  # unchanged
    foreground = httpx.post(base + "/v1/responses", json={"input": "Hi"}, timeout=30).json()
    r = httpx.post(f"{base}/v1/responses/{foreground['id']}/cancel", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    assert "background" in r.json()["error"]["message"]
    for r in (httpx.post(f"{base}/v1/responses/resp_nope/cancel", timeout=30),
              httpx.get(f"{base}/v1/responses/resp_nope", timeout=30)):
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


@pytest.mark.parametrize("fields, named", [
    ({"store": False}, "needs store: true"),
    ({"stream": True}, "background with stream is not served"),
])
def test_background_needs_store_and_is_not_streamed(scripted, fields, named):
    base = scripted([["Fine."]])
    r = httpx.post(base + "/v1/responses", json={"input": "Hi", "background": True, **fields}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
    assert named in r.json()["error"]["message"]


def test_background_needs_the_store_on_and_a_stream_is_not_resumed(tmp_path):
    with serve(ThinkingEngine_for([["Fine."]]), tmp_path, responses_store_bytes=0) as server:
        r = httpx.post(server.base_url + "/v1/responses", json={"input": "Hi", "background": True}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"
        assert "--responses-store-bytes" in r.json()["error"]["message"]
    with serve(ThinkingEngine_for([["Fine."]]), tmp_path) as server:
        r = httpx.post(server.base_url + "/v1/responses", json={"input": "Hi", "background": True}, timeout=30)
        got = httpx.get(f"{server.base_url}/v1/responses/{r.json()['id']}",
                        params={"stream": "true", "starting_after": 3}, timeout=30)
        assert got.status_code == 400 and got.json()["error"]["param"] == "stream"


def test_background_responses_past_the_limit_are_429(tmp_path):
    engine = SlowEngine([LONG], delay=0.01)
    with serve(engine, tmp_path, max_background_responses=1) as server:
        base = server.base_url
        first = started(base, engine)
        r = httpx.post(base + "/v1/responses", json={"input": "Hi", "background": True}, timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["param"] == "background" and "--max-background-responses" in error["message"]
        httpx.post(f"{base}/v1/responses/{first}/cancel", timeout=30)
        second = started(base, engine)  # room again once one has ended
        assert httpx.post(f"{base}/v1/responses/{second}/cancel", timeout=30).json()["status"] == "cancelled"
        assert engine.in_flight == 0 and engine.aborted == engine.started


def test_shutdown_cancels_the_running_background_responses(tmp_path):
    engine = SlowEngine([LONG], delay=0.01)
    server = serve(engine, tmp_path).start()
    started(server.base_url, engine)
    began = time.monotonic()
    server.stop()
    assert not server._thread.is_alive() and time.monotonic() - began < 10  # not the ~20 s the answer takes
    assert engine.in_flight == 0 and engine.aborted == engine.started and len(engine.started) == 1
    assert len(server.server.config.app.state.background_responses) == 0


def test_a_background_response_waits_for_room_and_records_its_failure(tmp_path):
    engine = SlowEngine([["Fine."]], refuse=[OverloadedError("no room", retry_after=0.01), OverloadedError("full")])
    with serve(engine, tmp_path) as server:
        base = server.base_url
        r = httpx.post(base + "/v1/responses", json={"input": "Hi", "background": True}, timeout=30)
        done = polled(base, r.json()["id"])  # queued again while the engine had no room, then answered
        assert done["status"] == "completed" and message_text(done) == "Fine." and not engine.refuse
        engine.refuse = [ContextLengthError("the prompt is longer than the context")]
        r = httpx.post(base + "/v1/responses", json={"input": "Hi", "background": True}, timeout=30)
        failed = polled(base, r.json()["id"])
        assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
        assert "longer than the context" in failed["error"]["message"]
        r = httpx.post(base + "/v1/responses", json={"input": "And?", "previous_response_id": failed["id"]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_a_background_response_larger_than_the_store_is_failed_not_lost(tmp_path):
    """Its client polls for it: an answer that cannot be kept leaves a failed entry saying why, not a 404."""
    settings = ServerSettings(files_dir=str(tmp_path), responses_store_bytes=64 << 10)
    with ServerThread(create_app(ThinkingEngine_for([["Fine."]]), settings)) as server:
        r = httpx.post(server.base_url + "/v1/responses", json={"input": "Hi", "instructions": "i" * (100 << 10),
                                                                "background": True}, timeout=30)
        got = polled(server.base_url, r.json()["id"])
        assert got["status"] == "failed" and got["error"]["code"] == "response_too_large"
        assert "--responses-store-bytes" in got["error"]["message"] and got["output"] == []

