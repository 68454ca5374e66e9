"""The Responses API's request side and store, without a server: input items become the chat the
request is answered as (messages, tools, formats, sampling fields), fields this server cannot honour
are refused by name, the response store stays within its bytes, least recently used out first
(hypothesis over random operation sequences), and the table of running background responses keeps
every one until it is stored, a cancel before its task starts included."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mm_pipeline.errors import InvalidMessageError
from mm_pipeline.server.protocol import ChatCompletionRequest
from mm_pipeline.server.responses import TokenLogprob, TopLogprob
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.responses_api.background import BackgroundResponses
from mm_pipeline.server.responses_api.output import (FunctionCallOutput, OutputMessage, OutputText, ReasoningOutput,
                                                     ReasoningText, ResponseObject)
from mm_pipeline.server.responses_api.as_chat import chat_body, chat_messages
from mm_pipeline.server.responses_api.protocol import ResponsesRequest
from mm_pipeline.server.responses_api.store import ResponseStore, entry_bytes, held_bytes


def body_of(**fields):
    body, turn = chat_body(ResponsesRequest.model_validate(fields), [])
    ChatCompletionRequest.model_validate(body)  # what the route sends on is a valid chat request
    return body, turn


def test_a_string_input_is_one_user_message_and_instructions_come_first():
    body, turn = body_of(input="Hi", instructions="Be brief.")
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert turn == [{"role": "user", "content": "Hi"}]  # what a later response continues: no instructions


def test_parts_take_the_chat_spelling_and_chat_parts_pass_as_they_are():
    video = {"type": "video_url", "video_url": {"url": "file:///clip.mp4"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body, _ = body_of(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is here?"}, {"type": "input_image", "image_url": "data:image/png;base64,AA",
                                                         "detail": "low"},
        {"type": "input_image", "file_id": "file-1"}, {"type": "input_file", "file_data": "AAAA", "filename": "a.mp4"},
        video, audio]}])
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "What is here?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
        {"type": "file", "file": {"file_id": "file-1"}}, {"type": "file", "file": {"file_data": "AAAA", "filename": "a.mp4"}},
        video, audio]


def test_calls_join_their_turn_and_reasoning_goes_to_the_next_assistant_turn():
    items = [{"role": "user", "content": "Weather in Paris and Rome?"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Two cities."}], "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sun"},
             {"type": "function_call_output", "call_id": "c2", "output": "rain"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Now one more."}]},
             {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": '{"city":"Oslo"}'}]
    msgs = chat_messages(ResponsesRequest.model_validate({"input": items}).input)
    call = lambda i, city: {"id": i, "type": "function", "function": {  # noqa: E731
        "name": "get_weather", "arguments": f'{{"city":"{city}"}}'}}
    assert msgs == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning_content": "Two cities.",
         "tool_calls": [call("c1", "Paris"), call("c2", "Rome")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"}, {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None, "reasoning_content": "Now one more.", "tool_calls": [call("c3", "Oslo")]}]


def test_sampling_tools_and_formats_map_onto_the_chat_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body, _ = body_of(input="x", max_output_tokens=7, temperature=0.5, top_p=0.9, top_logprobs=2, top_k=5, seed=3,
                      priority=0, cache_salt="tenant", stream=True,
                      tools=[{"type": "function", "name": "f", "parameters": schema, "strict": True}],
                      tool_choice={"type": "function", "name": "f"})
    assert (body["max_completion_tokens"], body["temperature"], body["top_p"]) == (7, 0.5, 0.9)
    assert (body["logprobs"], body["top_logprobs"], body["top_k"], body["seed"]) == (True, 2, 5, 3)
    assert body["cache_salt"] == "tenant" and body["stream_options"] == {"include_usage": True}
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    body, _ = body_of(input="x", text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": None, "description": None}}
    assert body_of(input="x", text={"format": {"type": "json_object"}})[0]["response_format"] == {"type": "json_object"}
    assert "response_format" not in body_of(input="x", text={"format": {"type": "text"}})[0]
    assert body_of(input="x", include=["message.output_text.logprobs"])[0]["top_logprobs"] == 0


@pytest.mark.parametrize("fields, named", [
    ({"background": True, "store": False}, "background.*needs store"),
    ({"background": True, "stream": True}, "background with stream is not served"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"), ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "web_search"), ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input items are"), ({"input": []}, "input"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"), ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"temperature": 3}, "temperature"), ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fields, named):
    with pytest.raises(ValidationError, match=named):
        ResponsesRequest.model_validate({"input": "x", **fields})


def test_a_forced_tool_choice_needs_tools_and_a_file_url_is_refused():
    with pytest.raises(ValueError, match="needs tools"):
        body_of(input="x", tool_choice="required")


@pytest.mark.parametrize("part, loc, named", [
    ({"type": "input_file", "file_url": "https://x/a.pdf"}, ("input", 1, "content", 2), "file_url"),
    ({"type": "input_image", "detail": "auto"}, ("input", 1, "content", 2), "exactly one of image_url or file_id"),
    ({"type": "input_image", "image_url": "data:image/png;base64,AA", "file_id": "file-1"}, ("input", 1, "content", 2),
     "exactly one of image_url or file_id"),
    ({"type": "input_image", "file_id": "file-1", "detail": "bogus"}, ("input", 1, "content", 2, "detail"),
     "detail is one of auto, low, high, not 'bogus'"),
])
def test_a_part_the_chat_cannot_take_is_refused_where_it_is(part, loc, named):
    with pytest.raises(InvalidMessageError) as got:
        body_of(input=[{"role": "user", "content": "Hi."}, {"role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}, part]}])
    assert got.value.loc == loc and str(got.value).startswith(f"{got.value.loc}: ") and named in str(got.value)
    for detail in ("auto", "low", "high"):  # OpenAI's values pass, by file and by URL
        body_of(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1", "detail": detail}]}])
        body_of(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": detail}]}])


def stored(store: ResponseStore, text: str) -> tuple[str, int | None]:
    """Store a response whose conversation is ``text``: its id, and its size when it fits."""
    response = ResponseObject(model="m")
    history = [{"role": "user", "content": text}]
    size = entry_bytes(response, history)
    if not store.fits(size):
        return response.id, None
    store.put(response, history, size)
    return response.id, size


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(0, 40_000),
       ops=st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 20_000), st.integers(0, 30)),
                    max_size=60))
def test_the_store_stays_within_its_bytes_and_drops_the_least_recently_used(budget, ops):
    store = ResponseStore(budget)
    ids: list[str] = []
    model: dict[str, int] = {}  # the store as it should be: id -> size, least recently used first
    for op, n, pick in ops:
        if op == "put":
            rid, size = stored(store, "x" * n)
            ids.append(rid)
            if size is not None:
                while model and sum(model.values()) + size > budget:
                    del model[next(iter(model))]  # the least recently used goes first
                model[rid] = size
        elif ids:
            rid = ids[pick % len(ids)]
            if op == "get":
                assert (store.get(rid) is not None) == (rid in model)
                if rid in model:
                    model[rid] = model.pop(rid)  # now the most recently used
            else:
                assert store.delete(rid) == (rid in model)
                model.pop(rid, None)
        assert list(store._entries) == list(model)
        assert store.bytes == sum(model.values()) <= budget
    empty = ResponseStore(0)
    stored(empty, "x")
    assert not empty.enabled and len(empty) == 0


def test_held_bytes_counts_the_strings_inline_media_holds():
    small = held_bytes([{"role": "user", "content": "hi"}])
    big = held_bytes([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "A" * 1_000_000}}]}])
    assert small < 1000 and 1_000_000 < big < 1_001_000


def test_held_bytes_counts_utf8_bytes_and_stops_counting_at_a_bound():
    base = held_bytes("")
    assert held_bytes("é" * 1000) - base == 2000 and held_bytes("日" * 1000) - base == 3000
    assert held_bytes("😀" * 1000) - base == 4000 and held_bytes("\ud800") - base == 3  # a lone surrogate too
    assert held_bytes([1] * 100, max_values=50) is None and held_bytes([1] * 100, max_values=101) == held_bytes([1] * 100)


def test_an_entry_is_charged_for_its_whole_response():
    """Instructions, tool schemas, text.format and output logprobs are a client's to grow: a store
    that charged only the conversation held 20 responses of 1 MiB instructions in 1 MiB."""
    history = [{"role": "user", "content": "Hi"}]
    bare = entry_bytes(ResponseObject(model="m"), history)
    schema = {"type": "object", "description": "d" * 50_000}
    req = ResponsesRequest.model_validate({
        "input": "Hi", "instructions": "i" * 100_000, "tools": [{"type": "function", "name": "f", "parameters": schema}],
        "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}})
    response = ResponseObject.of_request(req, "m", store=True)
    assert entry_bytes(response, history) - bare > 200_000
    store = ResponseStore(1 << 20)
    for k in range(20):
        kept = response.model_copy(update={"id": f"resp_{k}"})
        store.put(kept, history, entry_bytes(kept, history))
    assert store.bytes <= store.max_bytes and len(store) == 5  # 200 KiB a response
    tokens = [TokenLogprob(token="a", logprob=-1.0, bytes=[97], top_logprobs=[TopLogprob(token="b", logprob=-2.0)] * 5)]
    response.output.append(OutputMessage(content=[OutputText(text="a" * 1000, logprobs=tokens * 1000)]))
    assert entry_bytes(response, history) - entry_bytes(ResponseObject.of_request(req, "m", store=True), history) > (
        1000 * 6 * 64)  # every token and its top entries


def test_the_answer_message_joins_every_message_and_reasoning_item():
    call = FunctionCallOutput(call_id="c1", name="f", arguments="{}")
    response = ResponseObject(model="m", output=[
        ReasoningOutput(content=[ReasoningText(text="Think. ")]), OutputMessage(content=[OutputText(text="Checking.")]),
        call, ReasoningOutput(content=[ReasoningText(text="More.")]), OutputMessage(content=[OutputText(text=" Done.")])])
    assert response.answer_message() == {
        "role": "assistant", "content": "Checking. Done.", "reasoning_content": "Think. More.",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    only_calls = ResponseObject(model="m", output=[call]).answer_message()
    assert only_calls["content"] is None and "reasoning_content" not in only_calls


def test_a_background_request_is_queued_and_says_so():
    req = ResponsesRequest.model_validate({"input": "Hi", "background": True})
    response = ResponseObject.of_request(req, "m", store=True)
    assert (response.status, response.background) == ("queued", True)
    assert ResponseObject.of_request(ResponsesRequest.model_validate({"input": "Hi"}), "m", store=True).status == (
        "in_progress")


def test_background_responses_are_held_until_stored_whatever_ends_them():
    """Each is in the table until its ``keep`` has run: answered, failed, cancelled before its task
    took a step (a task cancelled then runs no line of its coroutine: the table would keep it
    forever, unstored), cancelled while it runs, or stopped by close; past the limit a 429."""

    async def scenario() -> dict[str, object]:
        table, kept, gate = BackgroundResponses(limit=3), {}, asyncio.Event()

        def start(name: str, answer) -> ResponseObject:
            response = ResponseObject(model="m", status="queued", background=True, id=name)

            async def keep() -> None:
                assert table.get(name) is not None  # still findable while it is being stored
                kept[name] = response.status

            table.start(response, [], lambda: answer(response), keep)
            return response

        async def answers(response: ResponseObject) -> None:
            response.status = "completed"

        async def fails(response: ResponseObject) -> None:
            raise RuntimeError("a bug")

        async def waits(response: ResponseObject) -> None:
            response.status = "in_progress"
            await gate.wait()

        start("early", waits)
        assert (await table.cancel("early")).status == "cancelled"  # before its task's first step
        start("done", answers), start("failed", fails), start("running", waits)
        with pytest.raises(APIError) as over:
            start("over", answers)
        await asyncio.sleep(0.01)
        assert (await table.cancel("running")).status == "cancelled" and await table.cancel("nope") is None
        start("at_close", waits)
        await asyncio.sleep(0.01)
        await table.close()
        with pytest.raises(APIError) as closed:
            start("after", answers)
        return {"kept": kept, "left": len(table), "over": over.value.status, "closed": closed.value.status}

    got = asyncio.run(scenario())
    assert got["kept"] == {"early": "cancelled", "done": "completed", "failed": "failed", "running": "cancelled",
                           "at_close": "failed"}  # ended by the shutdown, not by a client
    assert (got["left"], got["over"], got["closed"]) == (0, 429, 503)


def test_a_function_call_output_answers_a_call_of_the_conversation():
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    body_of(input=[{"role": "user", "content": "Weather?"}, call, answer])  # the call in this input
    stored = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    chat_body(ResponsesRequest.model_validate({"input": [answer]}), stored)  # the stored response's call
    for items, history in (([answer], []), ([call, {**answer, "call_id": "call_2"}], stored)):
        with pytest.raises(InvalidMessageError) as got:
            chat_body(ResponsesRequest.model_validate({"input": items}), history)
        assert got.value.loc == ("input", len(items) - 1, "call_id") and "no function_call" in str(got.value)
