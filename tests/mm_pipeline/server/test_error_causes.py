"""The HTTP statuses of test_error_statuses.py's table arising from real causes, through a tiny real
engine on CPU: a prompt over the context limit, broken media, a path outside the allowed
directories, a full admission queue, and an exception injected into a model step (500 while a
concurrent request is still served).
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.paths import SAMPLE_MEDIA as MEDIA
from tests.support.served import served_tiny_omni

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
