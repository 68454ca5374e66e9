"""``--tool-call-parser`` through the real server (uvicorn on 127.0.0.1, raw HTTP): a chat answer's
``<tool_call>`` blocks become ``message.tool_calls`` / ``delta.tool_calls``, streamed and not, each of
``n`` choices on its own, after the reasoning split; the request side's checks (tools with the parser
off, tool_choice values: "required" and a named function read the JSON a grammar forced).

The engine is test_reasoning_server.py's scripted one (fixed texts cut into deltas so that the tags
fall across them, tokenized by the demo model's tokenizer, in whose vocabulary ``<tool_call>`` is a
token: ``auto`` turns the parser on)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mm_pipeline.server import ServerSettings, ServerThread, create_app
from tests.mm_pipeline.server.test_reasoning_server import (GENERATION_PROMPT, PLAIN, ThinkingEngine, chat_stream,
                                                            streamed)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
# thinking, a sentence, two calls; the tags cut across deltas
CALLS = ["<think>Two cities.</thi", "nk>\n\nLet me check.\n<tool", "_call>\n<function=get_weather>\n<parameter=city>",
         "\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_", "call>\n<tool_call>",
         "\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"]
CALLS_RAW = "".join(CALLS)
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
ONLY_CALL = ["<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"]
UNCLOSED = ["Sure.", " <tool_call>\n<function=get_weather>\n<parameter=city>\nOs"]  # cut by max_tokens
QUESTION = [{"role": "user", "content": "Weather in Paris and Rome?"}]


@pytest.fixture(scope="module")
def serve(tokenizer, tmp_path_factory):
    servers: list[ServerThread] = []

    def start(scripts: list[list[str]], finish: str = "stop", **settings: Any) -> str:
        engine = ThinkingEngine(tokenizer, scripts, GENERATION_PROMPT, tokenizer, finish)
        server = ServerThread(create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("f")),
                                                                **settings))).start()
        servers.append(server)
        return server.base_url

    yield start
    for server in servers:
        server.stop()


def post(base: str, **fields: Any) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION, **fields}, timeout=30)


def calls_of(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    for c in tool_calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def streamed_calls(chunks: list[dict], index: int) -> list[dict]:
    got = [t for c in chunks if c["choices"][0]["index"] == index for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [t["index"] for t in got] == list(range(len(got)))
    return got


def test_a_non_streamed_answer_has_its_calls_in_tool_calls(serve):
    base = serve([CALLS])
    r = post(base, tools=TOOLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "Two cities."
    assert message["content"] == "Let me check.\n"
    assert calls_of(message["tool_calls"]) == EXPECTED
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert choice["finish_reason"] == "tool_calls"
    # only calls: content null, as OpenAI answers
    only = post(serve([ONLY_CALL]), tools=TOOLS).json()["choices"][0]
    assert only["message"]["content"] is None and calls_of(only["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Oslo"})]


def test_a_streamed_answer_sends_calls_as_tool_call_deltas(serve):
    base = serve([CALLS])
    chunks = chat_stream(base, messages=QUESTION, tools=TOOLS)
    got = streamed(chunks, 0)
    assert (got["reasoning"], got["content"]) == ("Two cities.", "Let me check.\n")  # == not streamed
    assert calls_of(streamed_calls(chunks, 0)) == EXPECTED
    assert got["finish_reason"] == "tool_calls"
    for d in got["deltas"]:
        assert "<" not in (d.get("content") or "")  # no tag text, whole or cut, as content


def test_each_of_n_choices_parses_its_own_calls(serve):
    base = serve([CALLS, PLAIN])
    whole = post(base, tools=TOOLS, n=2).json()["choices"]
    assert calls_of(whole[0]["message"]["tool_calls"]) == EXPECTED and whole[0]["finish_reason"] == "tool_calls"
    assert "tool_calls" not in whole[1]["message"] and whole[1]["finish_reason"] == "stop"
    assert whole[1]["message"]["content"] == "".join(PLAIN)
    chunks = chat_stream(base, messages=QUESTION, tools=TOOLS, n=2)
    assert calls_of(streamed_calls(chunks, 0)) == EXPECTED and streamed_calls(chunks, 1) == []
    assert streamed(chunks, 1)["content"] == "".join(PLAIN) and streamed(chunks, 1)["finish_reason"] == "stop"
    assert streamed(chunks, 0)["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(serve):
    base = serve([CALLS])
    message = post(base, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]
    assert calls_of(message["tool_calls"]) == EXPECTED[:1] and message["content"] == "Let me check.\n"
    chunks = chat_stream(base, messages=QUESTION, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(streamed_calls(chunks, 0)) == EXPECTED[:1] and streamed(chunks, 0)["finish_reason"] == "tool_calls"


def test_an_answer_with_calls_that_max_tokens_cut_ends_with_length(serve):
    """OpenAI's rule (vLLM says "tool_calls"): the client must know later calls may be missing."""
    base = serve([CALLS[:5]], finish="length")  # the first call, then the second one's opening tag
    out = post(base, tools=TOOLS).json()["choices"][0]
    assert calls_of(out["message"]["tool_calls"]) == EXPECTED[:1] and out["finish_reason"] == "length"
    assert streamed(chat_stream(base, messages=QUESTION, tools=TOOLS), 0)["finish_reason"] == "length"


def test_an_unclosed_call_is_text(serve):
    base = serve([UNCLOSED])
    message = post(base, tools=TOOLS).json()["choices"][0]["message"]
    assert message["content"] == "".join(UNCLOSED) and "tool_calls" not in message
    got = streamed(chat_stream(base, messages=QUESTION, tools=TOOLS), 0)
    assert got["content"] == "".join(UNCLOSED) and got["finish_reason"] == "stop"


def test_without_tools_or_with_tool_choice_none_nothing_is_parsed(serve):
    base = serve([CALLS])
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        message = post(base, **fields).json()["choices"][0]["message"]
        assert "tool_calls" not in message and message["content"].startswith("Let me check.\n<tool_call>")


def test_tools_with_the_parser_off_are_a_400_naming_the_flag(serve):
    base = serve([CALLS], tool_call_parser="none")
    r = post(base, tools=TOOLS)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    assert post(base, tools=[]).status_code == 200  # no tools: nothing to parse


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# what a grammar makes the model write for tool_choice named / "required" (thinking first), and one cut short
FORCED_NAMED = ["<think>Paris.</think>\n\n", '{"city": "Par', 'is", "days": 2}']
FORCED_REQUIRED = ['[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, ',
                   '{"name": "get_weather", "parameters": {"city": "Rome"}}]']
FORCED_CUT = ['[{"name": "get_weather", "parame']


@pytest.mark.parametrize("choice,script,expected", [
    (NAMED, FORCED_NAMED, EXPECTED[:1]), ("required", FORCED_REQUIRED, EXPECTED)])
def test_tool_choice_required_or_named_reads_the_forced_json_as_calls(serve, choice, script, expected):
    """The answer a grammar forced (tests/mm_pipeline/server/test_structured_outputs.py runs the real
    model) becomes tool_calls, streamed (whole, at the end) and not; the parser setting is not needed."""
    for base in (serve([script]), serve([script], tool_call_parser="none")):
        out = post(base, tools=TOOLS, tool_choice=choice).json()["choices"][0]
        assert calls_of(out["message"]["tool_calls"]) == expected and out["finish_reason"] == "tool_calls"
        assert out["message"]["content"] is None
        got = streamed(chat_stream(base, messages=QUESTION, tools=TOOLS, tool_choice=choice), 0)
        calls = [c for d in got["deltas"] for c in d.get("tool_calls") or []]
        assert calls_of(calls) == expected and got["finish_reason"] == "tool_calls" and got["content"] == ""
    cut = post(serve([FORCED_CUT]), tools=TOOLS, tool_choice="required").json()["choices"][0]
    assert cut["message"]["content"] == FORCED_CUT[0] and "tool_calls" not in cut["message"]


def test_bad_tools_are_a_400_naming_them(serve):
    base = serve([CALLS])
    r = post(base, tools=[{"type": "function", "function": {"name": "no spaces"}}])
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]


def test_a_batch_line_gets_the_servers_answer(tokenizer, tmp_path):
    """`mmserve batch` answers a chat line with tools as the server does (--tool-call-parser there too)."""
    import asyncio

    from mm_pipeline.jobs.batch import BatchJob

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": QUESTION, "tools": TOOLS}}) + "\n")
    engine = ThinkingEngine(tokenizer, [CALLS], GENERATION_PROMPT, tokenizer)
    asyncio.run(BatchJob(engine).run(src, out))
    body = json.loads(out.read_text())["response"]["body"]
    assert calls_of(body["choices"][0]["message"]["tool_calls"]) == EXPECTED
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    off = tmp_path / "off.jsonl"
    asyncio.run(BatchJob(engine, tool_call_parser="none").run(src, off))
    row = json.loads(off.read_text())["response"]
    assert row["status_code"] == 400 and "--tool-call-parser" in row["body"]["error"]["message"]
