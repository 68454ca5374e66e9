"""OpenAI's Responses API (``/v1/responses``) served in process, on the demo checkpoint.

A response is the chat answer to the same messages (text and an image,
instructions first), streamed events put together are the response not streamed, a follow-up by
``previous_response_id`` is the chat of the whole conversation (its prefix from the prefix cache),
stored responses are read and deleted, the OpenAI SDK's ``responses.create`` / ``retrieve`` /
``delete`` and its typed stream work, input items list the request input, a client that leaves
mid-stream frees its request, and bad requests are 4xx naming the problem.

The scripted engine's answers (reasoning and function_call items, the stream chunk by chunk):
test_responses_output_items.py; the response store and the conversations built from it:
test_responses_store.py; background mode: test_responses_background.py."""

from __future__ import annotations

import base64
import time

import pytest

from tests.support.paths import SAMPLE_MEDIA
from tests.support.responses_api import GREEDY, check_stream_is_the_response, events_of, message_text, needs_demo


def chat(client, messages: list[dict], **fields) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def respond(client, **fields) -> dict:
    r = client.post("/v1/responses", json={**GREEDY, **fields})
    assert r.status_code == 200, r.text
    return r.json()


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
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, 400,
         "input[0].call_id: no function_call with call_id 'nope'"),
    ])
    def test_bad_requests_are_4xx_naming_the_problem(self, demo_client, fields, status, named):
        r = demo_client.post("/v1/responses", json=fields)
        assert r.status_code == status, r.text
        assert named in r.json()["error"]["message"]
        assert respond(demo_client, input="Still fine?")["status"] == "completed"  # nothing leaked or stuck

    @pytest.mark.parametrize("part, param", [
        ({"type": "input_file", "file_url": "http://127.0.0.1/a"}, "input.0.content.1"),
        ({"type": "input_image", "image_url": "data:,", "file_id": "file-1"}, "input.0.content.1"),
        ({"type": "input_image", "file_id": "file-1", "detail": "bogus"}, "input.0.content.1.detail"),
        ({"type": "input_image", "image_url": "data:,", "detail": "bogus"}, "input.0.content.1.detail"),
    ])
    def test_a_part_the_chat_cannot_take_is_a_400_naming_it(self, demo_client, part, param):
        r = demo_client.post("/v1/responses", json={"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "Look:"}, part]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(param.replace(".0", "[0]").replace(".1", "[1]") + ":"), r.text

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
