"""OpenAI's Responses API (``/v1/responses``) on test_reasoning_server.py's scripted engine
(thinking and ``<tool_call>`` blocks on cue): the thinking becomes a reasoning item (its tokens
counted), calls become function_call items, streamed and not alike. Without a server, chunk by
chunk: the events ResponseEvents makes of a generation are the response the same generation gets
without stream (thinking, text, calls, cut by max_output_tokens)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from mm_pipeline.server.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                          ChatCompletionChunk, ChatLogprobs, Delta, TokenLogprob, TopLogprob, Usage)
from mm_pipeline.server.responses_api.events import ResponseEvents
from mm_pipeline.server.responses_api.output import ResponseObject, response_of_chat
from tests.mm_pipeline.server.test_reasoning_server import THINKS
from tests.mm_pipeline.server.test_tool_calls_server import CALLS, EXPECTED
from tests.support.responses_api import (GREEDY, TOOLS, check_stream_is_the_response, events_of, message_text,
                                         needs_demo)


# ---- thinking and tool calls (scripted engine) ------------------------------------------------------------
@needs_demo
def test_thinking_is_a_reasoning_item_with_its_tokens_counted(scripted, tokenizer):
    # the tags as the model writes them (single tokens), then THINKS' cut across deltas (no tag tokens)
    thought = "\nThe user asks 2+2 and wants it short."
    base = scripted([["<think>", thought, "</think>", "\n\nIt is", " 4."], THINKS])
    whole = httpx.post(base + "/v1/responses", json={**GREEDY, "input": "What is 2+2?"}, timeout=30).json()
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": thought}]
    assert message_text(whole) == "It is 4."
    thinking = len(tokenizer.encode(thought, add_special_tokens=False))
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == thinking > 0
    check_stream_is_the_response(events_of(base, input="What is 2+2?"), whole)
    # the chat answer counts it too (OpenAI's completion_tokens_details), choice by choice
    chat_usage = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Q"}],
                                                                  "n": 2}, timeout=30).json()["usage"]
    assert chat_usage["completion_tokens_details"] == {"reasoning_tokens": thinking}  # THINKS' tags are no tokens


@needs_demo
def test_tool_calls_are_function_call_items(scripted):
    base = scripted([CALLS])
    whole = httpx.post(base + "/v1/responses", json={**GREEDY, "input": "Weather in Paris and Rome?", "tools": TOOLS},
                       timeout=30).json()
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call", "function_call"]
    calls = [i for i in whole["output"] if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == EXPECTED
    assert all(c["call_id"].startswith("call_") and c["id"].startswith("fc_") for c in calls)
    assert whole["status"] == "completed" and whole["tools"] == TOOLS
    events = events_of(base, input="Weather in Paris and Rome?", tools=TOOLS)
    check_stream_is_the_response(events, whole)
    args = [e for e in events if e["type"].startswith("response.function_call_arguments")]
    assert [e["type"].rsplit(".", 1)[1] for e in args] == ["delta", "done"] * 2
    # the calls' results go back as input items: a valid conversation for the next turn
    follow = httpx.post(base + "/v1/responses", json={"input": [
        {"role": "user", "content": "Weather in Paris and Rome?"}, *whole["output"],
        *({"type": "function_call_output", "call_id": c["call_id"], "output": "sunny"} for c in calls)],
        "tools": TOOLS}, timeout=30)
    assert follow.status_code == 200, follow.text


# ---- the stream against the response, chunk by chunk (no server) ----------------------------------------
def _call(k: int) -> dict[str, Any]:
    return {"index": k, "id": f"call_{k}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": f"C{k}"})}}


THINK, TEXT, MARKUP, CALL = "think", "text", "markup", "call"  # what a token of a generation is


def stream_and_whole(tokens: list[tuple[str, Any]], finish: str = "stop") -> tuple[list[dict], dict]:
    """The events ResponseEvents makes of a generation's chunks, one token each as choices.py streams
    them (a tag or call markup: logprobs and no text; a call whole at its last token), and the
    response the same generation gets without stream."""
    chunks, thinking, content, calls, logprobs = [], "", "", [], []
    for k, (kind, value) in enumerate(tokens):
        lp = [TokenLogprob(token=f"t{k}", logprob=-0.5, top_logprobs=[TopLogprob(token=f"t{k}", logprob=-0.5)])]
        logprobs += lp
        delta = (Delta(reasoning_content=value) if kind == THINK else Delta(content=value) if kind == TEXT
                 else Delta(content="", tool_calls=[value] if kind == CALL else None))
        thinking += value if kind == THINK else ""
        content += value if kind == TEXT else ""
        calls += [value] if kind == CALL else []
        last = k == len(tokens) - 1
        chunks.append(ChatCompletionChunk(id="c", created=0, model="m", choices=[ChatChunkChoice(
            index=0, delta=delta, logprobs=ChatLogprobs(content=lp), finish_reason=finish if last else None)]))
    usage = Usage(prompt_tokens=3, completion_tokens=len(tokens), total_tokens=3 + len(tokens))
    chunks.append(ChatCompletionChunk(id="c", created=0, model="m", choices=[], usage=usage))

    async def stream() -> list[str]:
        async def each():
            for c in chunks:
                yield c
        return [e async for e in ResponseEvents(ResponseObject(model="m", created_at=0)).events(each())]

    events = [json.loads(e.split("\ndata: ", 1)[1]) for e in asyncio.run(stream())]
    message = AssistantMessage(content=content or (None if calls else ""), reasoning_content=thinking or None,
                               tool_calls=calls or None)
    whole = response_of_chat(ResponseObject(model="m", created_at=0), ChatCompletion(
        id="c", created=0, model="m", usage=usage, choices=[ChatChoice(
            index=0, message=message, logprobs=ChatLogprobs(content=logprobs), finish_reason=finish)]))
    return events, whole.model_dump()


THOUGHT = [(MARKUP, "")] + [(THINK, f" w{k}") for k in range(300)] + [(MARKUP, "")]  # <think> ... </think>
ANSWER = [(TEXT, "It is"), (TEXT, " 4.")]
CALLING = [(MARKUP, "")] * 3 + [(CALL, _call(0))]  # <tool_call> ... </tool_call>
DONE, CUT = "completed", "incomplete"


@pytest.mark.parametrize("tokens, finish, items", [
    # thinking tokens carry logprobs: one reasoning item, not one item per token; the message's logprobs
    # are every token's, as without stream
    (THOUGHT + ANSWER, "stop", [("reasoning", DONE), ("message", DONE)]),
    # text after a call is still the message's, listed before the calls
    ([(TEXT, "Checking.")] + CALLING + [(TEXT, " Done.")] + CALLING[:3] + [(CALL, _call(1))], "stop",
     [("message", DONE), ("function_call", DONE), ("function_call", DONE)]),
    (CALLING + [(TEXT, "Sent.")], "stop", [("message", DONE), ("function_call", DONE)]),
    (THOUGHT + CALLING, "stop", [("reasoning", DONE), ("function_call", DONE)]),  # no text: no message
    ([(MARKUP, "")], "stop", [("message", DONE)]),  # an empty answer is an empty message, its logprobs kept
    # cut by max_output_tokens: the item cut is incomplete, the ones before it completed, announced so
    (THOUGHT + ANSWER, "length", [("reasoning", DONE), ("message", CUT)]),
    (THOUGHT[:50], "length", [("reasoning", CUT)]),  # cut mid-thought: no (empty) message after it
    (THOUGHT + CALLING + [(MARKUP, "")], "length", [("reasoning", DONE), ("function_call", DONE)]),
])
def test_the_stream_is_the_response_for_the_same_generation(tokens, finish, items):
    events, whole = stream_and_whole(tokens, finish)
    final = check_stream_is_the_response(events, whole)
    assert [(i["type"], i["status"]) for i in final["output"]] == items
    assert ResponseObject.model_validate(final).answer_message() == ResponseObject.model_validate(whole).answer_message()
