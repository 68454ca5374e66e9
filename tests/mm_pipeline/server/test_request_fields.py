"""Every chat request field is honoured or refused by name (protocol.py, completions/sampling_fields.py,
prompt/messages.py).

A scripted engine (no model) stands behind the app and records what reaches it: fields that change
the answer in a way the server does not implement are a 400 naming them, their no-op values are
served; the roles the request model takes are the parser's; tool turns and refusals reach the
chat template as it renders them (checked against ``apply_chat_template`` of the demo checkpoint);
what cannot be rendered (``function_call``, tool calls on a non-assistant message) is refused
rather than dropped (tools and tool calls: prompt/test_tools_template.py, test_tool_calls_server.py; reasoning and the chat-template fields:
test_template_options.py). Streamed chunks have OpenAI's
shape with and without ``include_usage``, and a long conversation is parsed off the event loop.
"""

from __future__ import annotations

import json
import pickle
import threading
import typing
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

from mm_pipeline.prompt.messages import ROLES, ChatTurn, ParsedMessages, parse_messages
from mm_pipeline.server import ServerSettings, create_app
from mm_pipeline.server.completions import request_params
from mm_pipeline.server.protocol import ChatCompletionRequest, ChatMessage

from tests.mm_pipeline.server.test_error_statuses import CHAT, ScriptedEngine, _sse_events
from tests.support.paths import DEMO_MODEL


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping each chat's parse, its sampling params and the thread the
    event loop runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.chats: list[Any] = []
        self.params: list[Any] = []
        self.loop_thread: int | None = None

    async def generate(self, messages: list[dict], params: Any, *, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None
                       ) -> AsyncIterator[Any]:
        self.loop_thread = threading.get_ident()
        self.chats.append(parse_messages(messages))  # as OmniEngine.generate does
        self.params.append(params)
        async for delta in super().generate(messages, params, request_id=request_id):
            yield delta


@pytest.fixture()
def app(tmp_path):
    engine = RecordingEngine()
    with TestClient(create_app(engine, ServerSettings(files_dir=str(tmp_path))),
                    raise_server_exceptions=False) as client:
        client.engine = engine
        yield client


def _post(app, **fields) -> Any:
    return app.post("/v1/chat/completions", json={**CHAT, **fields})


# ---- request fields ------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("structural_tag", {"type": "structural_tag"}),
    ("guided_decoding_backend", "outlines"),
    ("chat_template", "{{ messages }}"),
    ("documents", [{"title": "t", "text": "x"}]),
    ("tool_choice", "sometimes"),
    ("reasoning_effort", "low"),
    ("modalities", ["text", "audio"]),
    ("length_penalty", 0.5),
    ("use_beam_search", True),
    ("echo", True),
])
def test_a_field_that_changes_the_answer_is_a_400_naming_it(app, field, value):
    r = _post(app, **{field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert app.engine.chats == []  # refused before anything started


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "text"}}, {"tools": [], "tool_choice": "none"}, {"presence_penalty": 0},
    {"chat_template_kwargs": {}, "continue_final_message": False, "add_generation_prompt": True},
    {"modalities": ["text"]},
    # metadata that does not change the answer is ignored, as by vLLM
    {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True},
])
def test_no_op_values_and_metadata_are_served(app, fields):
    assert _post(app, **fields).status_code == 200


def test_penalties_logit_bias_min_p_and_min_tokens_reach_the_engine(app):
    fields = dict(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.05, min_tokens=3,
                  logit_bias={"5": 10, "17": -100})
    assert _post(app, max_tokens=8, **fields).status_code == 200
    assert _post(app, presence_penalty=0, frequency_penalty=0, logit_bias={}, min_p=0, min_tokens=0,
                 repetition_penalty=1).status_code == 200
    got, default = app.engine.params
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty, got.min_p, got.min_tokens,
            got.logit_bias) == (0.5, -1.0, 1.2, 0.05, 3, ((5, 10.0), (17, -100.0)))
    assert not default.processes_logits and default.min_p == 0


def test_allowed_token_ids_and_bad_words_reach_the_engine(app):
    assert _post(app, max_tokens=8, allowed_token_ids=[9, 5, 5], bad_words=["no", "never"]).status_code == 200
    got = app.engine.params[-1]
    assert got.allowed_token_ids == (5, 9) and got.bad_words == ("no", "never") and got.processes_logits
    assert _post(app, max_tokens=8, stop=["x"], include_stop_str_in_output=True).status_code == 200
    assert app.engine.params[-1].include_stop_str_in_output


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0), ("min_p", 1.5),
    ("min_tokens", -1), ("min_tokens", 9), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("bad_words", [""]), ("bad_words", ["x" * 257]),
    ("bad_words", ["x"] * 65), ("stream_options", {"include_usage": True}),  # the last one: without stream
])
def test_bad_sampling_values_are_a_400_naming_the_field(app, field, value):
    r = _post(app, max_tokens=8, **{field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert app.engine.chats == []


def test_skip_special_tokens_reaches_the_engine(app):
    assert _post(app, skip_special_tokens=False).status_code == 200
    assert _post(app).status_code == 200
    assert [p.skip_special_tokens for p in app.engine.params] == [False, True]


# ---- roles and message fields --------------------------------------------------------------------
def test_the_request_model_takes_the_parsers_roles():
    assert typing.get_args(ChatMessage.model_fields["role"].annotation) == ROLES


def test_tool_turns_and_refusals_reach_the_template(app):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no."}]},
                {"role": "assistant", "content": None, "refusal": "still no."},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert _post(app, messages=messages).status_code == 200
    assert app.engine.chats[-1].turns == (ChatTurn("user", ("q",)), ChatTurn("assistant", ("no.",)),
                                          ChatTurn("assistant", ("still no.",)), ChatTurn("tool", ("42",)))


@pytest.mark.parametrize("message,field", [
    ({"role": "user", "content": "u",
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls"),
    ({"role": "assistant", "content": "a", "function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
    ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "refusal"),
])
def test_what_the_template_cannot_render_is_refused_by_name(app, message, field):
    r = _post(app, messages=[{"role": "user", "content": "q"}, message, {"role": "user", "content": "q2"}])
    assert r.status_code == 400, r.text
    assert "messages[1]" in r.json()["error"]["message"] and field in r.json()["error"]["message"]


def test_empty_tool_calls_and_reasoning_render_as_left_out(app):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "tool_calls": [], "reasoning_content": ""}]
    assert _post(app, messages=messages).status_code == 200
    assert app.engine.chats[-1].turns[1] == ChatTurn("assistant", ("a",))


@pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")
def test_tool_and_refusal_turns_render_as_the_chat_template_does():
    from llm_core.llm import load_tokenizer
    from mm_pipeline.model.config import OmniConfig
    from mm_pipeline.prompt.layout import ChatLayout

    tok = load_tokenizer(DEMO_MODEL)
    omni = OmniConfig.from_pretrained(DEMO_MODEL)
    layout = ChatLayout(omni.special, tok, omni.use_video_timestamps)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "calling"},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no."}]}]
    # what the template makes of a refusal: the text it is
    reference = [*messages[:3], {"role": "assistant", "content": [{"type": "text", "text": "no."}]}]
    req = ChatCompletionRequest(messages=messages)
    ours = layout.render(request_params._parsed_messages(req).chat, []).token_ids
    expected = tok.apply_chat_template(reference, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>42</tool_response>" in expected
    assert list(ours) == tok.encode(expected, add_special_tokens=False)


# ---- streamed chunks -----------------------------------------------------------------------------
def _chunks(app, **fields) -> list[dict]:
    r = _post(app, stream=True, n=2, **fields)
    assert r.status_code == 200
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_have_openais_shape(app, include_usage):
    chunks = _chunks(app, stream_options={"include_usage": include_usage})
    with_choices = [c for c in chunks if c["choices"]]
    seen_role: set[int] = set()
    for c in with_choices:
        (choice,) = c["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}  # nulls sent, not left out
        first = choice["index"] not in seen_role
        seen_role.add(choice["index"])
        expected = {"role": "assistant", "content": ""} if first else {"content": choice["delta"]["content"]}
        assert choice["delta"] == expected
    assert seen_role == {0, 1}
    assert sorted(c["choices"][0]["finish_reason"] for c in with_choices if c["choices"][0]["finish_reason"]) \
        == ["length", "length"]
    if include_usage:  # null in every chunk but the last, which has no choices
        assert all("usage" in c and c["usage"] is None for c in with_choices)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    else:
        assert all("usage" not in c for c in chunks)


# ---- parsing off the event loop -----------------------------------------------------------------
@pytest.mark.parametrize("messages,off_loop", [(1, False), (request_params._INLINE_PARTS + 1, True)])
def test_a_long_conversation_is_parsed_off_the_event_loop(app, monkeypatch, messages, off_loop):
    parsed_on: list[int] = []
    original = request_params._parsed_messages

    def parse(req):
        parsed_on.append(threading.get_ident())
        return original(req)

    monkeypatch.setattr(request_params, "_parsed_messages", parse)
    r = _post(app, messages=[{"role": "user", "content": "q"}] * messages)
    assert r.status_code == 200
    assert (parsed_on == [app.engine.loop_thread]) is not off_loop and len(parsed_on) == 1
    assert len(app.engine.chats[-1].turns) == messages  # the engine took that parse, not its own


def test_parsed_messages_keep_their_parse_but_not_in_a_pickle():
    msgs = ParsedMessages([{"role": "user", "content": "q"}])
    assert parse_messages(msgs) is msgs.chat and msgs[0]["content"] == "q"
    copy = pickle.loads(pickle.dumps(msgs))
    assert type(copy) is tuple and copy == ({"role": "user", "content": "q"},)
    assert json.dumps(msgs) == '[{"role": "user", "content": "q"}]'


def test_tools_and_assistant_tool_calls_reach_the_template(tmp_path):
    engine = RecordingEngine()  # no tokenizer: auto would be off, so the parser is forced on
    with TestClient(create_app(engine, ServerSettings(files_dir=str(tmp_path), tool_call_parser="qwen3_coder")),
                    raise_server_exceptions=False) as app:
        app.engine = engine
        _tools_reach_the_template(app)


def _tools_reach_the_template(app):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    r = _post(app, messages=messages, tools=tools, tool_choice="auto")
    assert r.status_code == 200, r.text
    chat = app.engine.chats[-1]
    assert chat.options.tools == tuple(tools)
    assert chat.turns[1].tool_calls == ({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},)
