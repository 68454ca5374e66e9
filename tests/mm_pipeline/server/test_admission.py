"""Admission slots come back on every path (issue 22, row 2).

An engine stream takes its admission slot when it starts and gives it back in its ``finally``; the
server must make that ``finally`` run for every choice of a request however the request ends. A
gated engine (the OmniEngine admission contract, no model) lets the sweep put a failure at each
step of starting N choices -- an error, an overload, a cancellation (client disconnect) -- with the
choices before it already answered and the ones after it still waiting. After each one the slot
count is back to 0 and the next request succeeds. Then a real tiny engine over HTTP: a request with
more choices than ``max_queue`` gets 429 and leaves nothing admitted, and the prompt count of
``/v1/completions`` is bounded with a 400 naming the limit.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import httpx
import pytest

from mm_pipeline.errors import InvalidInputError, OverloadedError
from mm_pipeline.runtime.omni_engine import GenerationDelta
from mm_pipeline.server.completions.chat_service import ChatService, ServiceConfig
from mm_pipeline.server.protocol import CompletionRequest

from tests.support.served import served_tiny_omni

N = 5


class GatedEngine:
    """``generate_prompt`` admits like OmniEngine (slot taken on the first ``__anext__``, released in
    ``finally``, 429 when full). Choice ``fail_at`` fails as ``mode`` says once admitted; choices
    before it answer at once; choices after it wait until released (still running when it fails)."""

    model_name = "gated"
    tokenizer = None

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self.in_flight = 0
        self.fail_at: int | None = None
        self.mode = "raise"
        self.admitted = asyncio.Event()  # the failing choice is admitted (the cancel mode waits for it)

    async def generate_prompt(self, prompt: Any, params: Any, *, request_id: str | None = None,
                              priority: int = 0, cache_salt: str | None = None
                              ) -> AsyncIterator[GenerationDelta]:
        index = int(str(request_id).rsplit("-", 1)[1])
        if self.mode == "overload" and index == self.fail_at:
            raise OverloadedError("full")  # refused before admission: no slot taken
        if self.in_flight >= self.limit:
            raise OverloadedError("full")
        self.in_flight += 1
        try:
            if index == self.fail_at:
                self.admitted.set()
                if self.mode == "raise":
                    raise InvalidInputError("bad prompt")
                await asyncio.Event().wait()  # "cancel": hangs until the request is cancelled
            if self.fail_at is not None and index > self.fail_at:
                await asyncio.Event().wait()  # still starting when the failure happens
            yield GenerationDelta(str(request_id), [1], "x", None, None, False, None, 2, 1, 0, time.time())
            yield GenerationDelta(str(request_id), [], "", None, None, True, "length", 2, 1, 0, time.time())
        finally:
            self.in_flight -= 1


def _request() -> CompletionRequest:
    return CompletionRequest(prompt=[[1, 2]] * N, max_tokens=1)


async def _one_failure(engine: GatedEngine, service: ChatService) -> None:
    engine.admitted.clear()
    task = asyncio.ensure_future(service.complete(_request()))
    if engine.mode == "cancel":
        await engine.admitted.wait()
        task.cancel()
    with pytest.raises((InvalidInputError, OverloadedError, asyncio.CancelledError)):
        await task


@pytest.mark.parametrize("mode", ["raise", "overload", "cancel"])
def test_every_failure_point_of_starting_choices_gives_every_slot_back(mode):
    async def sweep() -> None:
        engine = GatedEngine()
        service = ChatService(engine, ServiceConfig("gated"))
        for fail_at in range(N):
            engine.fail_at, engine.mode = fail_at, mode
            await _one_failure(engine, service)
            assert engine.in_flight == 0, f"{mode} at choice {fail_at}: {engine.in_flight} slots left admitted"
            engine.fail_at = None  # the next request succeeds and gives its slots back too
            answer = await service.complete(_request())
            assert [c.finish_reason for c in answer.choices] == ["length"] * N
            assert engine.in_flight == 0

    asyncio.run(sweep())


def test_a_stream_closed_after_start_gives_every_slot_back():
    """The streamed path: the response's close (its background task) releases every choice."""
    async def run() -> None:
        engine = GatedEngine()
        service = ChatService(engine, ServiceConfig("gated"))
        events, close = await service.complete_stream(CompletionRequest(prompt=[[1, 2]] * N, max_tokens=1,
                                                                        stream=True))
        assert engine.in_flight == N
        await events.__anext__()  # the client reads one event and goes away
        await close()
        await events.aclose()
        assert engine.in_flight == 0

    asyncio.run(run())


# ---- a real engine over HTTP ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_omni(tmp_path_factory, settings={"max_completion_prompts": 8}, num_full_tokens=2048,
                          max_queue=4, max_model_len=256) as server:
        yield server


def _wait_idle(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.requests_in_flight == 0


def test_more_choices_than_the_queue_is_400_and_leaves_nothing_admitted(served):
    """More choices than max_queue can never be admitted together: a 400 naming the limit (a 429
    would have the client, or a batch line, retry forever), with no slot taken."""
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        for body in ({"prompt": [[5, 6, 7]] * 6, "max_tokens": 4}, {"prompt": [5, 6, 7], "n": 5, "max_tokens": 4}):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"], r.text
            assert served.engine.requests_in_flight == 0
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 5,
                                                      "max_tokens": 2})
        assert r.status_code == 400 and "5 choices" in r.json()["error"]["message"], r.text
        r = client.post("/v1/completions", json={"prompt": [[5, 6, 7]] * 4, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 4
        _wait_idle(served.engine)


def test_the_prompt_count_of_a_completion_is_bounded(served):
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": [[5, 6]] * 300, "max_tokens": 1})
        assert r.status_code == 400
        assert "300 prompts" in r.json()["error"]["message"]
        assert "max_completion_prompts" in r.json()["error"]["message"]
        assert served.engine.requests_in_flight == 0
        assert client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_an_early_error_is_answered_at_once_on_an_idle_server(served):
    """A prompt the engine rejects at add_request (over the context limit) is answered within 2 s
    with nothing else running: the engine loop hands early outputs over without waiting for work."""
    _wait_idle(served.engine)
    with httpx.Client(base_url=served.base_url, timeout=30) as client:
        for body in ({"prompt": [5] * 400, "max_tokens": 4}, {"prompt": [5] * 400, "max_tokens": 4, "stream": True}):
            t0 = time.monotonic()
            r = client.post("/v1/completions", json=body)
            elapsed = time.monotonic() - t0
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert elapsed < 2.0, f"early error took {elapsed:.1f} s"
    _wait_idle(served.engine)
