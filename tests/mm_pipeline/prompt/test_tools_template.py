"""Tools and tool calls through the chat template (prompt/template_options.py ``check_tools``,
prompt/messages.py ``tool_calls``, ChatTemplate): the demo template renders the tool definitions into
its system turn and an assistant's tool calls back in MiMo's XML, and the prompt ids are those of
transformers' ``apply_chat_template(..., tools=...)``."""

from __future__ import annotations

import json

import pytest

from mm_pipeline.errors import InvalidMessageError
from mm_pipeline.prompt.messages import ParsedMessages, parse_messages
from mm_pipeline.prompt.template_options import MAX_TOOLS, TemplateOptions, check_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "days": {"type": "integer"}, "units": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now"}}

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "Let me look.", "reasoning_content": "two calls",
     "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2,
                                                                        "extra": {"a": [1, True, None]}})}},
         {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def _transformers_ids(tokenizer, messages, tools):
    hf = []
    for m in messages:  # transformers' convention, as vLLM hands it on: arguments as an object
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        hf.append(m)
    text = tokenizer.apply_chat_template(hf, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["own-system", "default-system"])
def test_prompt_ids_equal_transformers_with_tools(layout, tokenizer, messages):
    chat = parse_messages(messages, TemplateOptions(tools=(WEATHER, CLOCK)))
    ids = list(layout.render(chat, []).token_ids)
    assert ids == _transformers_ids(tokenizer, messages, [WEATHER, CLOCK])
    text = tokenizer.decode(ids)
    assert "<tools>\n<function>\n<name>get_weather</name>" in text and "<name>now</name>" in text
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=extra>\n{\"a\": [1, true, null]}\n</parameter>\n</function>\n</tool_call>"
            "\n<tool_call>\n<function=now>\n</function>\n</tool_call><|im_end|>") in text
    assert "<|im_start|>tool\n<tool_response>sunny</tool_response><|im_end|>" in text


def test_without_tools_the_prompt_is_as_before(layout, tokenizer):
    messages = [m for m in CHAT if "tool_calls" not in m]
    ids = list(layout.render(parse_messages(messages), []).token_ids)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False) and "<tools>" not in text


def test_tools_survive_pickling_with_the_parse():
    import pickle

    parsed = ParsedMessages(CHAT, TemplateOptions(tools=(WEATHER,)))
    again = pickle.loads(pickle.dumps(parsed))
    assert again.chat.options.tools == (WEATHER,)
    assert again.chat.turns[2].tool_calls[0]["function"]["arguments"]["city"] == "Paris"


@pytest.mark.parametrize("tools, match", [
    ([{"type": "function", "function": {"name": "a b"}}], "name must match"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "name must match"),
    ([{"type": "function"}], "must be"),
    ([{"type": "code_interpreter", "function": {"name": "a"}}], "must be"),
    ([CLOCK, CLOCK], "given twice"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], "at most 128"),
    ([{"type": "function", "function": {"name": "a", "description": "x" * 300_000}}], "bytes"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"p": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}}}],
     "deep"),
    ([{"type": "function", "function": {"name": "a", "parameters": "string"}}], "JSON schema"),
])
def test_bad_tools_are_refused(tools, match):
    with pytest.raises(InvalidMessageError, match=match):
        check_tools(tools)


@pytest.mark.parametrize("call, match", [
    ({"type": "function", "function": {"name": "f", "arguments": "{not json"}}, "not valid JSON"),
    ({"type": "function", "function": {"name": "f", "arguments": "[1]"}}, "JSON object"),
    ({"type": "function", "function": {"name": "bad name", "arguments": "{}"}}, "name must match"),
    ({"type": "function"}, "must be"),
    # deeper than json's parser stack: a 400, not a RecursionError (500)
    ({"type": "function", "function": {"name": "f", "arguments": '{"a":' + "[" * 5000 + "]" * 5000 + "}"}},
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments nests too deeply"),
    ({"type": "function", "function": {"name": "f", "arguments": '{"a":' * 3000 + "1" + "}" * 3000}}, "nests too deeply"),
    # deeper than the tools' limit: named by the call's own path, not the stand-in tool's
    ({"type": "function", "function": {"name": "f", "arguments": '{"a":' + "[" * 40 + "]" * 40 + "}"}},
     r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments\.a"),
])
def test_bad_tool_calls_are_refused(call, match):
    with pytest.raises(InvalidMessageError, match=match):
        parse_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}])


def test_tool_calls_on_a_user_message_are_refused():
    with pytest.raises(InvalidMessageError, match="only an assistant"):
        parse_messages([{"role": "user", "content": "x", "tool_calls": [CHAT[2]["tool_calls"][1]]}])


def test_a_special_token_spelled_in_tools_or_calls_is_refused(layout):
    tool = {"type": "function", "function": {"name": "f", "description": "a <|im_end|> b"}}
    with pytest.raises(InvalidMessageError, match="tools holds text"):
        layout.render(parse_messages(CHAT[1:2], TemplateOptions(tools=(tool,))), [])
    call = {"type": "function", "function": {"name": "f", "arguments": json.dumps({"x": "<|image_pad|>"})}}
    chat = parse_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "content": "ok"}])
    with pytest.raises(InvalidMessageError, match=r"messages\[1\].tool_calls holds text"):
        layout.render(chat, [])
