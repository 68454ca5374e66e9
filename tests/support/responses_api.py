"""Helpers of the Responses API tests (``/v1/responses``; tests/mm_pipeline/server/test_responses_*.py):
requests and their streamed events (``events_of``: every event of a streamed response, checked for
the SSE shape), ``check_stream_is_the_response`` (the streamed events against the response not
streamed), and test_reasoning_server.py's scripted engine over the demo checkpoint's tokenizer
(``ThinkingEngine_for``). The ``scripted`` fixture (servers of that engine) is in
tests/mm_pipeline/server/conftest.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.mm_pipeline.server.test_reasoning_server import GENERATION_PROMPT, ThinkingEngine
from tests.support.paths import DEMO_MODEL

needs_demo = pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")
GREEDY = {"max_output_tokens": 12, "temperature": 0}


def events_of(client_or_base, **fields) -> list[dict]:
    """Every event of a streamed response, checked for the SSE shape: named by its type, numbered from 0."""
    body = {**GREEDY, **fields, "stream": True}
    if isinstance(client_or_base, str):
        ctx = httpx.stream("POST", client_or_base + "/v1/responses", json=body, timeout=30)
    else:
        ctx = client_or_base.stream("POST", "/v1/responses", json=body)
    with ctx as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in s.iter_lines() if line]
    names, events = lines[0::2], [json.loads(x.removeprefix("data: ")) for x in lines[1::2]]
    assert names == [f"event: {e['type']}" for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def without_ids(output: list[dict]) -> list[dict]:
    """The items without their ids, and logprobs as their tokens (a prefix-cache hit moves the last digits)."""
    out = []
    for item in output:
        item = {k: v for k, v in item.items() if k not in ("id", "call_id")}
        if item["type"] == "message":
            item["content"] = [{**c, "logprobs": [t["token"] for t in c["logprobs"]]} for c in item["content"]]
        out.append(item)
    return out


def message_text(response: dict) -> str:
    return "".join(c["text"] for item in response["output"] if item["type"] == "message" for c in item["content"])


def check_stream_is_the_response(events: list[dict], whole: dict) -> dict:
    """The streamed events agree with themselves and with the response not streamed; the last event's response."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds.count(kinds[-1]) == 1
    final = events[-1]["response"]
    assert kinds[-1] == ("response.incomplete" if whole["status"] == "incomplete" else "response.completed")
    assert without_ids(final["output"]) == without_ids(whole["output"])
    # the rest alike, usage too but the prefix-cache hits (the second request finds the first's prefix)
    same = lambda r: {k: v for k, v in r.items() if k not in ("id", "created_at", "output", "usage")}  # noqa: E731
    assert same(final) == same(whole)
    assert {**final["usage"], "input_tokens_details": None} == {**whole["usage"], "input_tokens_details": None}
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["id"] for i in added] == [i["id"] for i in done] == [i["id"] for i in final["output"]]
    assert done == final["output"]
    for item in final["output"]:  # each item's deltas put together are its text
        deltas = [e["delta"] for e in events if e.get("item_id") == item["id"] and e["type"].endswith(".delta")]
        text = {"message": lambda i: i["content"][0]["text"], "reasoning": lambda i: i["content"][0]["text"],
                "function_call": lambda i: i["arguments"]}[item["type"]](item)
        assert "".join(deltas) == text
    return final


_TOKENIZER: list[Any] = []


def demo_tokenizer() -> Any:
    if not _TOKENIZER:
        from llm_core.llm import load_tokenizer
        _TOKENIZER.append(load_tokenizer(DEMO_MODEL))
    return _TOKENIZER[0]


def ThinkingEngine_for(scripts: list[list[str]]) -> ThinkingEngine:  # noqa: N802  (a factory of the class)
    tok = demo_tokenizer()
    return ThinkingEngine(tok, scripts, GENERATION_PROMPT, tok)


TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}}]
