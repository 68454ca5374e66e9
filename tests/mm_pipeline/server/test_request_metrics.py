"""Per-request metrics through the served app (uvicorn on 127.0.0.1, real disconnects): every request
is observed once however it ends -- a client leaving a stream or a request not streamed, an engine
ending a stream in error or abort, a normal end (never twice) --; its time to first token when the
token comes; every gap between a choice's tokens; each of n choices its own end; the request log
line of a multi-prompt completion; a mid-stream error's log line naming the request.

The engine is scripted (no model): each choice writes a number of tokens, ``per_delta`` at a time
after ``gap_s``, then ends as told (or never, until it is closed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mm_pipeline.runtime.omni_engine import GenerationDelta
from mm_pipeline.server import ServerSettings, ServerThread, create_app

CHAT = {"model": "paced", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
PROMPT_TOKENS = 3  # a chat's, as the scripted engine counts it


@dataclass(frozen=True)
class Script:
    """Choice i writes ``tokens[i]`` tokens (the last entry for the choices past it), ``per_delta``
    a delta, each delta ``gap_s`` after the one before; then its last delta ends it with ``end``
    (finish_reason, error_kind), or with ``end`` None it goes on until closed."""

    tokens: tuple[int, ...] = (4,)
    per_delta: int = 1
    gap_s: float = 0.0
    end: tuple[str, str | None] | None = ("length", None)


class PacedEngine:
    """OmniEngine's generate API over a ``Script`` (``self.script``, set by each test)."""

    model_name = "paced"
    tokenizer = None

    def __init__(self) -> None:
        self.script = Script()

    async def generate(self, messages: Any, params: Any, *, request_id: str = "r-0", priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[GenerationDelta]:
        async for d in self._run(request_id, PROMPT_TOKENS):
            yield d

    async def generate_prompt(self, prompt: Any, params: Any, *, request_id: str = "r-0", priority: int = 0,
                              cache_salt: str | None = None) -> AsyncIterator[GenerationDelta]:
        async for d in self._run(request_id, len(prompt) if isinstance(prompt, list) else PROMPT_TOKENS):
            yield d

    async def _run(self, rid: str, prompt_tokens: int) -> AsyncIterator[GenerationDelta]:
        s = self.script
        choice = int(rid.rsplit("-", 1)[1])
        total = s.tokens[min(choice, len(s.tokens) - 1)]
        done = 0
        while s.end is None or done < total:
            await asyncio.sleep(s.gap_s)
            k = s.per_delta if s.end is None else min(s.per_delta, total - done)
            done += k
            last = s.end is not None and done == total
            reason, kind = s.end if last else (None, None)
            yield GenerationDelta(rid, [7] * k, "a" * k, None, None, last, reason, prompt_tokens, done, 0, time.time(),
                                  error="scripted failure" if reason == "error" else None, error_kind=kind,
                                  prompt_token_ids=[1] * prompt_tokens if done == k else None)

    def stats(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = PacedEngine()
    app = create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files")), log_requests=True))
    with ServerThread(app) as server:
        server.engine = engine
        yield server


def scrape(server: ServerThread) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.base_url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def grown(before: dict, after: dict, name: str, **labels: str) -> float:
    """How much one sample grew between two scrapes."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def settle(server: ServerThread, before: dict, until: Callable[[dict], bool], seconds: float = 10.0) -> dict:
    """Scrape until ``until(scrape)`` holds (else fail), then once more a little later: what an end
    observed twice would have added by then is in the last scrape."""
    deadline = time.monotonic() + seconds
    while not until(now := scrape(server)):
        assert time.monotonic() < deadline, {k: v for k, v in now.items() if v != before.get(k, 0.0)}
        time.sleep(0.05)
    time.sleep(0.3)
    return scrape(server)


def aborted_once(server: ServerThread, before: dict, ttft: int) -> dict:
    """The request ended as one abort: one of each per-generation family, ``ttft`` times to first token."""
    after = settle(server, before, lambda m: grown(before, m, "mmserve_request_success_total", finished_reason="abort"))
    assert grown(before, after, "mmserve_request_success_total", finished_reason="abort") == 1
    for family in ("e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert grown(before, after, f"mmserve_{family}_count") == 1, family
    assert grown(before, after, "mmserve_time_to_first_token_seconds_count") == ttft
    return after


def test_a_client_that_leaves_a_stream_is_one_abort_with_its_first_token_time(served):
    served.engine.script = Script(gap_s=0.01, end=None)  # never ends by itself
    before = scrape(served)
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 4:  # the role, then tokens: leave mid-stream
                break
    after = aborted_once(served, before, ttft=1)
    assert grown(before, after, "mmserve_request_generation_tokens_sum") >= 3


def test_a_client_that_abandons_a_request_not_streamed_is_one_abort_with_its_first_token_time(served):
    served.engine.script = Script(gap_s=0.01, end=None)
    before = scrape(served)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base_url + "/v1/chat/completions", json=CHAT, timeout=0.5)
    after = aborted_once(served, before, ttft=1)
    assert grown(before, after, "mmserve_requests_total", endpoint="/v1/chat/completions", status="499") == 1


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", {"model": "paced", "prompt": "hi", "max_tokens": 64})])
@pytest.mark.parametrize("end,status", [(("abort", None), 503), (("error", "internal"), 500)])
def test_a_stream_the_engine_ends_in_error_is_counted_and_its_log_line_names_it(served, caplog, route, body, end,
                                                                                 status):
    served.engine.script = Script(tokens=(3,), end=end)
    before = scrape(served)
    with caplog.at_level(logging.INFO, logger="mmserve.server"):
        with httpx.stream("POST", served.base_url + route, json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            rid = r.headers["x-request-id"]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    after = settle(served, before, lambda m: grown(before, m, "mmserve_request_success_total", finished_reason=end[0]))
    assert grown(before, after, "mmserve_request_success_total", finished_reason=end[0]) == 1
    assert grown(before, after, "mmserve_time_to_first_token_seconds_count") == 1
    assert grown(before, after, "mmserve_e2e_request_latency_seconds_count") == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "mmserve.server"]
    assert any(m.startswith(f"{rid}: POST '{route} (stream already started)' -> {status} ") for m in logged), logged


def test_normal_requests_are_counted_once_and_every_gap_between_tokens_is_observed(served):
    # 7 tokens in deltas of 2, 2, 2, 1, 10 ms apart: 6 gaps; the token with the first is a zero gap,
    # a later delta's two tokens share its 10 ms (5 ms each: not zero, as a lagging consumer's merged
    # steps read as zero gaps and made the median 0 under load)
    served.engine.script = Script(tokens=(7,), per_delta=2, gap_s=0.01)
    before = scrape(served)
    assert httpx.post(served.base_url + "/v1/chat/completions", json=CHAT).status_code == 200
    for route, body in (("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}),
                        ("/v1/completions", {"model": "paced", "prompt": "hi"})):
        with httpx.stream("POST", served.base_url + route, json={**body, "stream": True}) as r:
            assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    after = settle(served, before, lambda m: grown(before, m, "mmserve_request_success_total",
                                                   finished_reason="length") >= 3)
    assert grown(before, after, "mmserve_request_success_total", finished_reason="length") == 3
    for family in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                   "request_time_per_output_token_seconds", "request_generation_tokens"):
        assert grown(before, after, f"mmserve_{family}_count") == 3, family
    assert grown(before, after, "mmserve_inter_token_latency_seconds_count") == 3 * 6
    assert grown(before, after, "mmserve_inter_token_latency_seconds_bucket", le="0.001") == 3 * 1  # with the first
    # the gaps add up to each generation's last - first token time: the per-request means' numerators
    gaps = grown(before, after, "mmserve_inter_token_latency_seconds_sum")
    means = grown(before, after, "mmserve_request_time_per_output_token_seconds_sum")
    assert gaps == pytest.approx(6 * means, rel=1e-6) and gaps >= 3 * 3 * 0.01


def test_each_of_n_choices_ends_at_its_own_time(served):
    served.engine.script = Script(tokens=(1, 12), gap_s=0.05)  # choice 0 ends after ~0.05 s, choice 1 ~0.6 s
    before = scrape(served)
    r = httpx.post(served.base_url + "/v1/chat/completions", json={**CHAT, "n": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 13
    after = settle(served, before, lambda m: grown(before, m, "mmserve_e2e_request_latency_seconds_count") >= 2)
    assert grown(before, after, "mmserve_e2e_request_latency_seconds_count") == 2
    assert grown(before, after, "mmserve_e2e_request_latency_seconds_bucket", le="0.25") == 1  # the short one
    assert grown(before, after, "mmserve_request_time_per_output_token_seconds_count") == 1  # one token: no mean


def test_the_request_log_line_counts_a_multi_prompt_completion_as_its_usage(served, caplog):
    served.engine.script = Script(tokens=(2,))
    body = {"model": "paced", "prompt": [[1, 2, 3], [4, 5, 6, 7, 8]], "n": 2, "max_tokens": 2,
            "request_id": "two-prompts"}
    with caplog.at_level(logging.INFO, logger="mmserve.requests"):
        usage = httpx.post(served.base_url + "/v1/completions", json=body).json()["usage"]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("cmpl-two-prompts: "))
    assert usage["prompt_tokens"] == 3 + 5 and usage["completion_tokens"] == 4 * 2
    assert f"prompt {usage['prompt_tokens']} tokens (cached 0)" in line, line
    assert f"completion {usage['completion_tokens']} tokens, n 2, prompts 2," in line, line
