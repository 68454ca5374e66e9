"""OpenAI's Responses API (``/v1/responses``) served in process.

On the demo checkpoint: a response is the chat answer to the same messages (text and an image,
instructions first), streamed events put together are the response not streamed, a follow-up by
``previous_response_id`` is the chat of the whole conversation (its prefix from the prefix cache),
stored responses are read and deleted, the OpenAI SDK's ``responses.create`` / ``retrieve`` /
``delete`` and its typed stream work, and bad requests are 4xx naming the problem.

On test_reasoning_server.py's scripted engine (thinking and ``<tool_call>`` blocks on cue): the
thinking becomes a reasoning item (its tokens counted), calls become function_call items, streamed
and not alike. Background mode (a slow scripted engine that counts its open generations): the
answer polled is the foreground one, a cancel aborts the engine requests (none left open), a
shutdown too, the limit is a 429, and the combinations it cannot serve are 400s naming them."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import httpx
import pytest

from mm_pipeline.errors import ContextLengthError, OverloadedError
from mm_pipeline.server import ServerSettings, ServerThread, create_app
from mm_pipeline.server.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                          ChatCompletionChunk, ChatLogprobs, Delta, TokenLogprob, TopLogprob, Usage)
from mm_pipeline.server.responses_api.events import ResponseEvents
from mm_pipeline.server.responses_api.output import ResponseObject, response_of_chat
from tests.mm_pipeline.server.test_reasoning_server import GENERATION_PROMPT, THINKS, ThinkingEngine
from tests.mm_pipeline.server.test_tool_calls_server import CALLS, EXPECTED
from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

needs_demo = pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")
GREEDY = {"max_output_tokens": 12, "temperature": 0}


def chat(client, messages: list[dict], **fields) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def respond(client, **fields) -> dict:
    r = client.post("/v1/responses", json={**GREEDY, **fields})
    assert r.status_code == 200, r.text
    return r.json()


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


# ---- the demo checkpoint --------------------------------------------------------------------------------
@needs_demo
@pytest.mark.usefixtures("one_thread")
class TestDemo:
    def test_a_response_is_the_chat_answer(self, demo_client):
        want = chat(demo_client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Red square?"}])
        got = respond(demo_client, input="Red square?", instructions="Be brief.", metadata={"run": "1"})
        assert got["object"] == "response" and got["id"].startswith("resp_") and got["status"] == "completed"
        assert message_text(got) == want["choices"][0]["message"]["content"]
        u, w = got["usage"], want["usage"]
        assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (
            w["prompt_tokens"], w["completion_tokens"], w["total_tokens"])
        assert (got["instructions"], got["metadata"], got["max_output_tokens"], got["store"]) == (
            "Be brief.", {"run": "1"}, 12, True)
        assert got["text"] == {"format": {"type": "text"}} and got["tool_choice"] == "auto"

    def test_an_image_input_is_the_chat_answer_to_the_image(self, demo_client):
        url = "data:image/jpeg;base64," + base64.b64encode((SAMPLE_MEDIA / "image_000002.jpg").read_bytes()).decode()
        want = chat(demo_client, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]}])
        got = respond(demo_client, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url, "detail": "auto"},
            {"type": "input_text", "text": "Describe the image."}]}])
        assert message_text(got) == want["choices"][0]["message"]["content"] and message_text(got)
        assert got["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]

    def test_a_streamed_response_is_the_response(self, demo_client):
        whole = respond(demo_client, input="Describe a blue circle.", top_logprobs=2)
        events = events_of(demo_client, input="Describe a blue circle.", top_logprobs=2)
        final = check_stream_is_the_response(events, whole)
        logprobs = final["output"][-1]["content"][0]["logprobs"]
        assert len(logprobs) == whole["usage"]["output_tokens"] and all(len(t["top_logprobs"]) == 2 for t in logprobs)
        for got, want in zip(logprobs, whole["output"][-1]["content"][0]["logprobs"], strict=True):
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        # cut by max_output_tokens: incomplete, streamed and not
        cut = respond(demo_client, input="Describe a blue circle.", max_output_tokens=1)
        assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
        check_stream_is_the_response(events_of(demo_client, input="Describe a blue circle.", max_output_tokens=1), cut)

    def test_a_follow_up_continues_the_stored_conversation(self, demo_client):
        first = respond(demo_client, input="Name a shape.")
        follow = respond(demo_client, input="And a colour?", previous_response_id=first["id"])
        want = chat(demo_client, [{"role": "user", "content": "Name a shape."},
                                  {"role": "assistant", "content": message_text(first)},
                                  {"role": "user", "content": "And a colour?"}])
        assert message_text(follow) == want["choices"][0]["message"]["content"]
        assert follow["previous_response_id"] == first["id"]
        assert follow["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
        assert follow["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the first turn's prefix
        # a streamed follow-up of the follow-up: its answer is stored when the stream ends
        events = events_of(demo_client, input="Thanks.", previous_response_id=follow["id"])
        third = events[-1]["response"]
        assert demo_client.get(f"/v1/responses/{third['id']}").json() == third

    def test_stored_responses_are_read_and_deleted(self, demo_client):
        got = respond(demo_client, input="Hello.")
        assert demo_client.get(f"/v1/responses/{got['id']}").json() == got
        gone = demo_client.delete(f"/v1/responses/{got['id']}")
        assert gone.status_code == 200 and gone.json() == {"id": got["id"], "object": "response.deleted", "deleted": True}
        for r in (demo_client.get(f"/v1/responses/{got['id']}"), demo_client.delete(f"/v1/responses/{got['id']}")):
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        r = demo_client.post("/v1/responses", json={"input": "Hi", "previous_response_id": got["id"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        unstored = respond(demo_client, input="Hello.", store=False)
        assert unstored["store"] is False and demo_client.get(f"/v1/responses/{unstored['id']}").status_code == 404

    @pytest.mark.parametrize("fields, status, named", [
        ({"input": "x", "background": True, "store": False}, 400, "background: a background response needs store"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, 400, "file_search"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input items are"),
        ({"input": "x", "model": "gpt-5"}, 404, "gpt-5"),
        ({"input": "x", "tool_choice": "required"}, 400, "needs tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "http://127.0.0.1/a"}]}]}, 400,
         "file_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
         415, "not a supported image"),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "role"),
        ({"input": "x", "n": 2, "top_k": -5}, 400, "top_k"),
    ])
    def test_bad_requests_are_4xx_naming_the_problem(self, demo_client, fields, status, named):
        r = demo_client.post("/v1/responses", json=fields)
        assert r.status_code == status, r.text
        assert named in r.json()["error"]["message"]
        assert respond(demo_client, input="Still fine?")["status"] == "completed"  # nothing leaked or stuck

    def test_the_openai_sdk_creates_streams_retrieves_and_deletes(self, demo_client):
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=str(demo_client.base_url).rstrip("/") + "/v1", api_key="none", max_retries=0)
        got = client.responses.create(model="demo-model", input="Describe a red square.", **GREEDY)
        assert got.output_text == message_text(respond(demo_client, input="Describe a red square.")) and got.output_text
        assert got.usage.input_tokens > 0 and got.status == "completed"
        stream = client.responses.create(model="demo-model", input="Describe a red square.", stream=True, **GREEDY)
        kinds = [e.type for e in stream]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert client.responses.retrieve(got.id).output_text == got.output_text
        (item,) = client.responses.input_items.list(got.id).data
        assert item.type == "message" and item.content[0].text == "Describe a red square."
        client.responses.delete(got.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(got.id)

    def test_input_items_list_the_request_input(self, demo_client):
        items = [{"role": "system", "content": "Be brief."},
                 {"type": "message", "id": "msg_mine", "role": "user",
                  "content": [{"type": "input_text", "text": "Name a shape."}]},
                 {"role": "assistant", "content": "A square."}, {"role": "user", "content": "Another?"}]
        got = respond(demo_client, input=items)
        listed = demo_client.get(f"/v1/responses/{got['id']}/input_items", params={"order": "asc"}).json()
        data = listed["data"]
        assert [i["role"] for i in data] == ["system", "user", "assistant", "user"] and data[1]["id"] == "msg_mine"
        assert data[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
        assert data[2]["content"] == [{"type": "output_text", "text": "A square."}]
        assert len({i["id"] for i in data}) == 4 and not listed["has_more"]
        # newest first by default; pages by limit and after
        desc = demo_client.get(f"/v1/responses/{got['id']}/input_items", params={"limit": 2}).json()
        assert [i["id"] for i in desc["data"]] == [data[3]["id"], data[2]["id"]] and desc["has_more"]
        rest = demo_client.get(f"/v1/responses/{got['id']}/input_items",
                               params={"limit": 2, "after": desc["last_id"]}).json()
        assert [i["id"] for i in rest["data"]] == [data[1]["id"], data[0]["id"]] and not rest["has_more"]
        one = respond(demo_client, input="Hello.")
        (only,) = demo_client.get(f"/v1/responses/{one['id']}/input_items").json()["data"]
        assert only["role"] == "user" and only["content"] == [{"type": "input_text", "text": "Hello."}]
        assert demo_client.get("/v1/responses/resp_nope/input_items").status_code == 404

    def test_a_client_that_leaves_mid_stream_frees_its_request(self, demo_client, demo_engine):
        body = {"input": "Describe a red square.", "max_output_tokens": 1900, "ignore_eos": True, "stream": True}
        with demo_client.stream("POST", "/v1/responses", json=body) as s:
            for line in s.iter_lines():
                if "response.output_text.delta" in line:
                    break  # hang up while it is being written
        steps = demo_engine.stats().engine_loop["steps"]
        deadline = time.monotonic() + 10
        while demo_engine.requests_in_flight:
            assert time.monotonic() < deadline, "the abandoned request was not aborted"
            time.sleep(0.02)
        assert demo_engine.stats().engine_loop["steps"] - steps < 1500  # aborted, not run to its 1,900 tokens
        assert respond(demo_client, input="Still fine?")["status"] == "completed"

    def test_openapi_documents_the_routes(self, demo_client):
        paths = demo_client.get("/openapi.json").json()["paths"]
        assert "requestBody" in paths["/v1/responses"]["post"] and "get" in paths["/v1/responses/{response_id}"]
        assert "post" in paths["/v1/responses/{response_id}/cancel"]


def test_a_store_of_zero_bytes_keeps_nothing(tmp_path):
    engine = ThinkingEngine_for([["Fine."]])
    with ServerThread(create_app(engine, ServerSettings(files_dir=str(tmp_path), responses_store_bytes=0))) as server:
        r = httpx.post(server.base_url + "/v1/responses", json={"input": "Hi"}, timeout=30).json()
        assert r["store"] is False and message_text(r) == "Fine."
        assert httpx.get(server.base_url + f"/v1/responses/{r['id']}", timeout=30).status_code == 404



def test_the_store_charges_a_response_and_its_conversation(tmp_path):
    """The store's bound counts the whole response (instructions here): 16 KiB of instructions each,
    a 64 KiB store keeps at most three of eight, not all."""
    settings = ServerSettings(files_dir=str(tmp_path), responses_store_bytes=64 << 10)
    with ServerThread(create_app(ThinkingEngine_for([["Fine."]]), settings)) as server:
        ids = [httpx.post(server.base_url + "/v1/responses", json={"input": "Hi", "instructions": "i" * (16 << 10)},
                          timeout=30).json()["id"] for _ in range(8)]
        kept = [i for i in ids if httpx.get(server.base_url + f"/v1/responses/{i}", timeout=30).status_code == 200]
        assert 0 < len(kept) <= 3 and kept == ids[-len(kept):]  # the most recent, within the bytes


def test_a_background_response_larger_than_the_store_is_failed_not_lost(tmp_path):
    """Its client polls for it: an answer that cannot be kept leaves a failed entry saying why, not a 404."""
    settings = ServerSettings(files_dir=str(tmp_path), responses_store_bytes=64 << 10)
    with ServerThread(create_app(ThinkingEngine_for([["Fine."]]), settings)) as server:
        r = httpx.post(server.base_url + "/v1/responses", json={"input": "Hi", "instructions": "i" * (100 << 10),
                                                                "background": True}, timeout=30)
        got = polled(server.base_url, r.json()["id"])
        assert got["status"] == "failed" and got["error"]["code"] == "response_too_large"
        assert "--responses-store-bytes" in got["error"]["message"] and got["output"] == []


def test_a_long_conversation_is_turned_into_a_chat_and_stored_off_the_event_loop(tmp_path, monkeypatch):
    """A one-item follow-up of a long stored conversation is long: its chat is built and validated,
    and its entry sized, on a thread (the event loop serves every other request meanwhile)."""
    from mm_pipeline.server.responses_api import routes

    def on_loop() -> bool:
        try:
            return asyncio.get_running_loop() is not None
        except RuntimeError:
            return False

    ran: list[tuple[str, bool]] = []

    def watched(name: str, fn):
        def run(*args):
            ran.append((name, on_loop()))
            return fn(*args)
        return run

    monkeypatch.setattr(routes, "_chat_request", watched("chat", routes._chat_request))
    monkeypatch.setattr(routes, "_sized_entry", watched("size", routes._sized_entry))
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"m{k}"} for k in range(routes._INLINE_ITEMS)]
    with ServerThread(create_app(ThinkingEngine_for([["Fine."]]), ServerSettings(files_dir=str(tmp_path)))) as server:
        first = httpx.post(server.base_url + "/v1/responses", json={"input": turns[:3]}, timeout=30).json()
        assert ran == [("chat", True), ("size", True)]  # short: inline
        ran.clear()
        # as many items as are validated inline; its entry (1,000s of values) is sized on a thread
        long = httpx.post(server.base_url + "/v1/responses", json={"input": turns}, timeout=30).json()
        assert ran == [("chat", True), ("size", True), ("size", False)]
        ran.clear()
        follow = httpx.post(server.base_url + "/v1/responses", json={"input": "And?", "previous_response_id": long["id"]},
                            timeout=30)
        assert follow.status_code == 200 and first["status"] == "completed"
        assert ran == [("chat", False), ("size", False)]  # one item, but the history's too


@pytest.mark.parametrize("bad, param", [
    ({"role": "user", "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_text", "text": 5}]},
     "input.2.content.1"),
    ({"type": "function_call_output", "call_id": "c1", "output": [{"type": "bogus"}]}, "input.2.output.0"),
])
def test_a_bad_input_part_is_named_by_its_input_item(scripted, bad, param):
    """The chat request names its messages; the error names the Responses input item (instructions
    and the stored conversation come before it in the chat)."""
    base = scripted([["Fine."]])
    first = httpx.post(base + "/v1/responses", json={"input": "Hi"}, timeout=30).json()
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"role": "user", "content": "One more."}, bad]
    r = httpx.post(base + "/v1/responses", json={"input": items, "instructions": "Be brief.",
                                                 "previous_response_id": first["id"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(param + ":")


# ---- thinking and tool calls (scripted engine) ------------------------------------------------------------
_TOKENIZER: list[Any] = []


def demo_tokenizer() -> Any:
    if not _TOKENIZER:
        from llm_core.llm import load_tokenizer
        _TOKENIZER.append(load_tokenizer(DEMO_MODEL))
    return _TOKENIZER[0]


def ThinkingEngine_for(scripts: list[list[str]]) -> ThinkingEngine:  # noqa: N802  (a factory of the class)
    tok = demo_tokenizer()
    return ThinkingEngine(tok, scripts, GENERATION_PROMPT, tok)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    servers: list[ServerThread] = []

    def start(scripts: list[list[str]]) -> str:
        settings = ServerSettings(files_dir=str(tmp_path_factory.mktemp("f")))
        server = ServerThread(create_app(ThinkingEngine_for(scripts), settings)).start()
        servers.append(server)
        return server.base_url

    yield start
    for server in servers:
        server.stop()


TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}}]


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
    (THOUGHT[:50], "length", [("reasoning", CUT), ("message", CUT)]),  # cut mid-thought
    (THOUGHT + CALLING + [(MARKUP, "")], "length", [("reasoning", DONE), ("function_call", DONE)]),
])
def test_the_stream_is_the_response_for_the_same_generation(tokens, finish, items):
    events, whole = stream_and_whole(tokens, finish)
    final = check_stream_is_the_response(events, whole)
    assert [(i["type"], i["status"]) for i in final["output"]] == items
    assert ResponseObject.model_validate(final).answer_message() == ResponseObject.model_validate(whole).answer_message()


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
