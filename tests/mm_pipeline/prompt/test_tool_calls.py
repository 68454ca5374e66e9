"""The tool-call parser (mm_pipeline/prompt/tool_calls.py) on its own: the documented decisions,
streamed == not streamed for any text cut anywhere (hypothesis), what it holds back, the parameter
types, and how ``--tool-call-parser`` is resolved for a model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.prompt.tool_calls import (END, START, ToolCallParser, ToolCallSyntax, ToolSplit, convert_value,
                                           forced_call_schema,
                                           resolve_tool_calls)
from tests.support.paths import DEMO_MODEL

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "maybe": {"type": ["integer", "null"]}}}}}]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
PARIS = ("get_weather", {"city": "Paris"})


def _shape(split: ToolSplit):
    return split.content, [(c.name, json.loads(c.arguments)) for c in split.calls]


def _parse(text: str):
    return _shape(ToolCallParser(TOOLS).parse(text))


@pytest.mark.parametrize("text, content, calls", [
    ("No call here.", "No call here.", []),
    (CALL, "", [PARIS]),
    ("Let me check.\n\n" + CALL, "Let me check.\n\n", [PARIS]),
    (CALL + "\n" + CALL + "\n", "", [PARIS, PARIS]),
    (CALL + "\nDone.", "\nDone.", [PARIS]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "<function=now>\n</function>\n</tool_call>", "", [PARIS, ("now", {})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", "", [("get_weather", {"city": "New\nYork", "days": 3})]),
    # tolerated as vLLM: a parameter closed by the next one or by the function's end
    ("<tool_call><function=get_weather><parameter=city>Paris<parameter=days>2</function></tool_call>", "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("<tool_call>not a call</tool_call>", "<tool_call>not a call</tool_call>", []),  # malformed: text
    ("a " + CALL[:-5], "a " + CALL[:-5], []),  # unclosed (cut by max_tokens): text
    (CALL + "\n<tool_call>\n<function=x>", "<tool_call>\n<function=x>", [PARIS]),  # the call made stays
    ("a <tool_cal", "a <tool_cal", []),
    ("a </tool_call> b", "a </tool_call> b", []),
])
def test_the_documented_decisions(text, content, calls):
    assert _parse(text) == (content, calls)
    parser = ToolCallParser(TOOLS)
    out = ToolSplit()
    for ch in text:
        out += parser.feed(ch)
    assert _shape(out + parser.finish()) == (content, calls)


@pytest.mark.parametrize("name, text, value", [
    ("city", "42", "42"), ("city", "null", "null"), ("days", "3", 3), ("days", "3.0", 3), ("days", "3.5", "3.5"),
    ("days", "three", "three"), ("days", "null", None), ("temp", "2.5", 2.5), ("temp", "-1", -1),
    ("temp", "1e400x", "1e400x"), ("metric", "True", True), ("metric", "false", False), ("metric", "yes", "yes"),
    ("opts", '{"a": [1]}', {"a": [1]}), ("opts", "[1]", "[1]"), ("opts", "{bad", "{bad"), ("tags", '["x", 2]', ["x", 2]),
    ("maybe", "7", 7), ("maybe", "NULL", None), ("unknown", "7", "7"),
])
def test_parameter_types_follow_the_schema(name, text, value):
    props = TOOLS[0]["function"]["parameters"]["properties"]
    assert convert_value(text, props.get(name)) == value
    block = f"<tool_call>\n<function=get_weather>\n<parameter={name}>\n{text}\n</parameter>\n</function>\n</tool_call>"
    assert _parse(block) == ("", [("get_weather", {name: value})])


def test_an_undeclared_function_is_still_a_call_with_string_arguments():
    assert _parse("<tool_call>\n<function=other>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>") == (
        "", [("other", {"n": "1"})])


def test_calls_get_distinct_openai_ids():
    calls = ToolCallParser(TOOLS).parse(CALL + CALL).calls
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].as_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


_PIECES = st.sampled_from([START, END, "<tool_", "call>", "</tool", "<", "</", ">", "\n", " ", "a", "é",
                           "<function=get_weather>", "<function=now>", "</function>", "<parameter=city>",
                           "<parameter=days>", "</parameter>", "Paris", "3", "<function=", "<parameter="])
_TEXTS = st.one_of(st.lists(_PIECES, max_size=30).map("".join), st.text(max_size=60))


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@settings(max_examples=600, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=14))
def test_streamed_equals_whole_text_for_any_cut(text, cuts):
    """The deltas' content and calls == the one-shot parse; content sent is never a tag's beginning
    held in the middle: what is held is a possible start of <tool_call>, an open block, or
    whitespace (with a possible start) after a call."""
    parser = ToolCallParser(TOOLS)
    out = ToolSplit()
    for chunk in _chunks(text, cuts):
        out += parser.feed(chunk)
        held = parser.held
        assert (held.startswith(START) or START.startswith(held.lstrip())), held
    assert _shape(out + parser.finish()) == _parse(text)


@settings(max_examples=200, deadline=None)
@given(before=st.text(max_size=20).filter(lambda t: "<" not in t), city=st.text(max_size=20).filter(
    lambda t: "<" not in t))
def test_a_well_formed_call_round_trips(before, city):
    block = f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
    assert _parse(before + block) == (before, [("get_weather", {"city": city})])


def test_a_stream_holds_back_only_what_may_be_a_call():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Sure <tool") == ToolSplit("Sure ") and parser.held == "<tool"
    assert parser.feed("_call>\n<function=get_weather>") == ToolSplit()
    split = parser.feed("\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n")
    assert _shape(split) == ("", [PARIS]) and parser.held == "\n"
    assert parser.feed("ok") == ToolSplit("\nok")
    assert parser.finish() == ToolSplit()


class _Tok:
    def __init__(self, vocab=(), template=None) -> None:
        self.vocab, self.template = {t: i for i, t in enumerate(vocab)}, template

    def get_vocab(self):
        return self.vocab

    def get_chat_template(self):
        if self.template is None:
            raise ValueError("no template")
        return self.template


def test_auto_is_on_when_the_model_knows_tool_call():
    from llm_core.llm import load_tokenizer

    assert resolve_tool_calls("auto", load_tokenizer(DEMO_MODEL)) == ToolCallSyntax()
    assert resolve_tool_calls("auto", _Tok(["<tool_call>"])) == ToolCallSyntax()
    assert resolve_tool_calls("auto", _Tok(template="... <tool_call> ...")) == ToolCallSyntax()
    for tok in (None, _Tok(["a"]), _Tok(template="{{ messages }}")):
        assert resolve_tool_calls("auto", tok) is None
        assert resolve_tool_calls("qwen3_coder", tok) == ToolCallSyntax()
    assert resolve_tool_calls("none", _Tok(["<tool_call>"])) is None
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, qwen3_coder, none; got 'hermes'"):
        resolve_tool_calls("hermes", None)


def test_the_setting_and_its_flags(tmp_path, capsys):
    from mm_pipeline import cli
    from mm_pipeline.server.launch.serve_settings import server_settings
    from mm_pipeline.jobs.batch import BatchConfig
    from mm_pipeline.server.settings import ServerSettings

    assert ServerSettings().tool_call_parser == "auto" and BatchConfig().tool_call_parser == "auto"
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, qwen3_coder, none; got 'on'"):
        ServerSettings(tool_call_parser="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        BatchConfig(tool_call_parser="on")
    args = cli.parse_args(["serve", "--model", "m", "--tool-call-parser", "none"])
    assert server_settings(args, tmp_path).tool_call_parser == "none"
    assert cli.parse_args(["batch", "-i", "a", "-o", "b", "--tool-call-parser", "qwen3_coder"]).tool_call_parser == (
        "qwen3_coder")
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["serve", "--model", "m", "--tool-call-parser", "hermes"])
    assert exit_.value.code == 2 and "--tool-call-parser" in capsys.readouterr().err


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# what pydantic writes for nested models and enums ($defs, definitions), a recursive schema ("#"), a
# pointer into itself, and a property named like a keyword whose value holds a reference
NODE = {"type": "object", "properties": {"label": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}},
                                         "same": {"$ref": "#/properties/label"}}, "required": ["label"]}
UNITS = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}}, "definitions": {"Day": {"type": "integer", "minimum": 1}},
         "properties": {"unit": {"$ref": "#/$defs/Unit"}, "enum": {"$ref": "#/definitions/Day"},
                        "tag": {"const": {"$ref": "#/not/a/ref"}}}, "required": ["unit"]}


def test_required_calls_keep_each_tools_references():
    """tool_choice "required": each tool's schema moves under the array's $defs and its references
    follow it, so the array schema accepts and refuses what each tool's own schema does (checked with
    jsonschema), and xgrammar compiles it."""
    import jsonschema
    import xgrammar as xgr

    schema = forced_call_schema([_tool("tree", NODE), _tool("weather", UNITS)], None)
    xgr.Grammar.from_json_schema(json.dumps(schema))
    good = [[{"name": "tree", "parameters": {"label": "a", "kids": [{"label": "b", "kids": []}], "same": "x"}}],
            [{"name": "weather", "parameters": {"unit": "c", "enum": 3, "tag": {"$ref": "#/not/a/ref"}}},
             {"name": "tree", "parameters": {"label": "r"}}]]
    bad = [[], [{"name": "tree", "parameters": {"label": "a", "kids": [{"kids": []}]}}],  # a kid without its label
           [{"name": "tree", "parameters": {"label": "a", "same": 5}}],
           [{"name": "weather", "parameters": {"unit": "k"}}], [{"name": "weather", "parameters": {"unit": "c", "enum": 0}}],
           [{"name": "weather", "parameters": {"unit": "c", "tag": {"$ref": "#/$defs/tool_1/not/a/ref"}}}]]
    own = {"tree": jsonschema.Draft202012Validator(NODE), "weather": jsonschema.Draft202012Validator(UNITS)}
    for call in (c for calls in good + bad for c in calls):  # one call: the array's verdict is its tool's
        assert jsonschema.Draft202012Validator(schema).is_valid([call]) == own[call["name"]].is_valid(call["parameters"])
    for calls in good:
        jsonschema.validate(calls, schema)
    for calls in bad:
        assert not jsonschema.Draft202012Validator(schema).is_valid(calls), calls
    one = forced_call_schema([_tool("tree", NODE)], None, parallel=False)
    assert jsonschema.Draft202012Validator(one).is_valid(good[0])
    assert not jsonschema.Draft202012Validator(one).is_valid(good[0] * 2)  # parallel_tool_calls false: one call
    assert forced_call_schema([_tool("tree", NODE)], "tree") == NODE  # a named function: its schema as written
