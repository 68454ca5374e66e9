"""Structured outputs through the OpenAI server (the demo checkpoint, in process): OpenAI's
``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` and its older
``guided_*`` fields reach the engine as one ``StructuredOutputsParams`` (chat answers with the
reasoning gate, completions without), and the answers are in their language -- streamed or not,
``n`` > 1, chat and completions. Each malformed constraint is a 400 naming it, a schema that compiles
too slowly is a 400 at the time limit, and none of them holds a slot (one that waits out the limit behind other compiles is a 429);
``--structured-outputs-backend
none`` turns the feature off (a 400), from the command line or the config.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from llm_core.engine.structured import StructuredOutputsParams
from mm_pipeline.server import ServerSettings, ServerThread, create_app
from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

USER = [{"role": "user", "content": "Describe the picture."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "count"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9}}}


def conforms(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"color", "count"} and value["color"] in ("red", "green", "blue") and 0 <= value["count"] <= 9


@pytest.fixture(scope="module")
def engine(demo_engine):
    return demo_engine


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    app = create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files"))))
    with ServerThread(app) as served, httpx.Client(base_url=served.base_url, timeout=120) as c:
        yield c


@pytest.fixture
def handed(engine, monkeypatch):
    """The SamplingParams of every request the engine is handed."""
    got = []
    submit = engine.runtime.submit

    def recording(request_id, token_ids, params, *args, **kwargs):
        got.append(params)
        return submit(request_id, token_ids, params, *args, **kwargs)

    monkeypatch.setattr(engine.runtime, "submit", recording)
    return got


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 40, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_every_request_form_reaches_the_engine_as_one_constraint(client, engine, handed):
    forms = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
         StructuredOutputsParams(json=SCHEMA)),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
         StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputsParams(regex="[0-9]{3}")),
        ({"structured_outputs": {"choice": ["cat", "dog"]}}, StructuredOutputsParams(choice=("cat", "dog"))),
        ({"structured_outputs": {"grammar": 'root ::= "x" | "y"'}}, StructuredOutputsParams(grammar='root ::= "x" | "y"')),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=("a", "b"))),
        ({"guided_grammar": 'root ::= "z"'}, StructuredOutputsParams(grammar='root ::= "z"')),
        ({"response_format": {"type": "text"}}, None),
    ]
    for body, want in forms:
        handed.clear()
        chat(client, max_tokens=2, **body)
        got = handed[0].structured_outputs
        if want is None:
            assert got is None
            continue
        # chat answers hold the constraint after the model's thinking (the demo model thinks in <think>)
        assert got.reasoning is not None and got.reasoning.start_id == engine.tokenizer.convert_tokens_to_ids("<think>")
        assert got.compile_key == want.compile_key, body
    handed.clear()
    r = client.post("/v1/completions", json={"prompt": "The answer is", "max_tokens": 2,
                                             "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.status_code == 200, r.text
    assert handed[0].structured_outputs == StructuredOutputsParams(choice=("alpha", "beta"))  # no gate: raw text


def test_answers_are_in_their_language(client):
    for extra in (NO_THINKING, {}):
        out = chat(client, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}, **extra)["choices"][0]
        assert out["finish_reason"] == "stop" or extra == {}, out  # thinking may use up max_tokens
        if out["finish_reason"] == "stop":
            assert conforms(out["message"]["content"]), out
    out = chat(client, structured_outputs={"choice": ["cat", "dog", "a \"bird\""]}, **NO_THINKING)["choices"][0]
    assert out["finish_reason"] == "stop" and out["message"]["content"] in ("cat", "dog", 'a "bird"')
    out = chat(client, structured_outputs={"regex": r"[a-c]{2}-\d"}, **NO_THINKING)["choices"][0]
    assert out["finish_reason"] == "stop" and re.fullmatch(r"[a-c]{2}-\d", out["message"]["content"])
    sampled = chat(client, guided_choice=["yes", "no"], n=3, temperature=1.2, seed=5, **NO_THINKING)["choices"]
    assert len(sampled) == 3 and all(c["message"]["content"] in ("yes", "no") for c in sampled)
    r = client.post("/v1/completions", json={"prompt": "The answer is", "max_tokens": 20, "temperature": 0,
                                             "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.json()["choices"][0]["text"] in ("alpha", "beta")


def test_a_streamed_answer_is_the_answer(client):
    body = {"messages": USER, "max_tokens": 40, "temperature": 0, **NO_THINKING,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    parts = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    parts.append(c["delta"].get("content") or "")
    assert "".join(parts) == whole and whole.lstrip().startswith("{")


BAD = [
    ({"structured_outputs": {"regex": "(ab"}}, "invalid structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "invalid structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "invalid structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": []}}, "1 to 1024"),
    ({"structured_outputs": {"regex": "a" * (64 * 1024 + 1)}}, "at most 65536"),
    ({"guided_choice": [str(i) for i in range(1025)]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "give one structured output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "give one structured output constraint"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structural_tag": "{}"}, "structural_tag is not supported"),
    # keywords the grammar would not hold the answer to (llm_core/engine/structured/schema_support.py)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}}}}, "uniqueItems at #: unique items"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer", "not": {"enum": [4]}}}}}},
     "not at #/properties/n"),
    ({"guided_json": {"$ref": "http://127.0.0.1:1/x.json"}}, "only local $ref pointers"),
    # named by the field the client sent, a forced call's schema by its tool
    ({"tools": [{"type": "function", "function": {"name": "g"}}, {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"y": {"not": {}}}}}}], "tool_choice": "required"},
     "tools cannot be held to: not at tools[1].function.parameters#/properties/y"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "a" * 70000}}}}, "response_format.json_schema.schema is 70"),
    ({"guided_choice": []}, "guided_choice must hold 1 to 1024"),
]


def test_a_bad_constraint_is_a_400_naming_it_and_holds_nothing(client, engine):
    for body, message in BAD:
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text[:300])
    assert engine.requests_in_flight == 0
    assert chat(client, structured_outputs={"choice": ["ok"]}, **NO_THINKING)["choices"][0]["message"]["content"] == "ok"


def test_a_constraint_no_token_can_satisfy_is_a_400(client, engine):
    """A grammar that admits no token, or a constraint whose tokens allowed_token_ids / bad_words
    exclude: the first step finds every token masked -- the request's error (400 naming it), not an
    internal one after a forbidden token was sampled (500); streamed, the stream ends with it."""
    for body, names in (({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs"),
                        ({"structured_outputs": {"choice": ["yes"]}, "allowed_token_ids": [5]},
                         "structured_outputs and allowed_token_ids")):
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **NO_THINKING, **body})
        assert r.status_code == 400, r.text[:300]
        assert "no token can follow" in r.json()["error"]["message"] and names in r.json()["error"]["message"]
        streamed = client.post("/v1/chat/completions",
                               json={"messages": USER, "max_tokens": 4, "stream": True, **NO_THINKING, **body})
        assert "no token can follow" in streamed.text and "internal" not in streamed.text
    assert engine.requests_in_flight == 0


def test_a_slow_schema_is_a_400_at_the_time_limit_and_others_go_on(client, engine, monkeypatch):
    grammars = engine.runtime.llm.grammars
    grammars.compile(StructuredOutputsParams(regex="warm"))  # the worker is up: its start is not timed here
    monkeypatch.setattr(grammars, "timeout_s", 1.0)
    hostile = {"type": "string", "pattern": "(a|b)*c{1,50000}"}  # minutes to compile
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4,
                                                  "structured_outputs": {"json": hostile}})
    assert r.status_code == 400 and "took longer than 1 s to compile" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 30
    assert chat(client, max_tokens=3)["choices"][0]["finish_reason"] in ("stop", "length")  # unconstrained: fine
    assert chat(client, structured_outputs={"choice": ["fine"]}, **NO_THINKING)["choices"][0]["message"]["content"] == "fine"
    # a constraint that waits its whole limit for the compiler (another one holds it) is a 429: retry
    with grammars._turn:
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4,
                                                      "structured_outputs": {"choice": ["new", "one"]}})
    assert r.status_code == 429 and "compiler is busy" in r.json()["error"]["message"] and r.headers["retry-after"]
    assert engine.requests_in_flight == 0


def test_the_backend_can_be_turned_off(client, engine, monkeypatch):
    from mm_pipeline.cli import build_parser
    from mm_pipeline.config_flags import config_flags, config_values
    from mm_pipeline.runtime.config import OmniEngineConfig

    assert OmniEngineConfig().engine.structured_outputs_backend == "xgrammar"  # on by default
    args = build_parser().parse_args(["serve", "--model", "m", "--structured-outputs-backend", "none",
                                      "--grammar-compile-timeout-s", "3"])
    cfg = OmniEngineConfig.from_kwargs(**config_values(args, config_flags())).engine
    assert cfg.structured_outputs_backend == "none" and cfg.grammar_compile_timeout_s == 3
    monkeypatch.setattr(engine.runtime.llm, "grammars", None)  # what an engine built with "none" holds
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4,
                                                  "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "structured outputs are off" in r.json()["error"]["message"]
    assert engine.requests_in_flight == 0


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]


def test_tool_choice_required_or_named_forces_calls(client, handed):
    """tool_choice "required" / a named function: the answer is JSON a grammar forces (vLLM's way),
    turned into tool_calls whatever the model would have written (the parsing of every outcome:
    test_tool_calls_server.py, on scripted answers)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    base = {"messages": USER, "max_tokens": 60, "temperature": 0, "tools": WEATHER, **NO_THINKING}
    for stream in (False, True):
        body = {**base, "tool_choice": named}
        if not stream:
            out = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            calls, finish = out["message"]["tool_calls"], out["finish_reason"]
            assert out["message"]["content"] is None
        else:
            calls, finish = [], None
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            calls += c["delta"].get("tool_calls") or []
                            finish = c["finish_reason"] or finish
        assert finish == "tool_calls" and len(calls) == 1, stream
        args = json.loads(calls[0]["function"]["arguments"])
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
    assert handed[0].structured_outputs.kind == "json" and handed[0].structured_outputs.disable_any_whitespace
    # "required": an array of calls; the demo model goes on adding calls until max_tokens, and an
    # unfinished array is the answer's text, held to the grammar as far as it got
    out = client.post("/v1/chat/completions", json={**base, "tool_choice": "required"}).json()["choices"][0]
    if out["finish_reason"] == "tool_calls":
        assert all(c["function"]["name"] in ("get_weather", "get_time") for c in out["message"]["tool_calls"])
    else:
        assert out["finish_reason"] == "length" and out["message"]["content"].startswith('[{"name": "get_')
    # parallel_tool_calls false: the array closes after one call; a tool whose parameters hold $defs /
    # $ref (pydantic's, the OpenAI SDK's pydantic_function_tool) still resolves inside the array
    with_defs = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "$defs": {"Unit": {"enum": ["c", "f"]}}, "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                                 "unit": {"$ref": "#/$defs/Unit"}}}}}]
    out = client.post("/v1/chat/completions", json={**base, "tools": with_defs, "tool_choice": "required",
                                                    "parallel_tool_calls": False, "max_tokens": 120}).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and len(out["message"]["tool_calls"]) == 1, out
    args = json.loads(out["message"]["tool_calls"][0]["function"]["arguments"])
    assert args["city"] in ("Paris", "Rome") and args["unit"] in ("c", "f"), args


def test_forced_tool_choice_is_checked(client, engine):
    named = {"type": "function", "function": {"name": "get_time"}}
    bad = [({"tool_choice": "required"}, "needs tools"),
           ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
           ({"tools": WEATHER, "tool_choice": named, "response_format": {"type": "json_object"}},
            "one structured output constraint"),
           ({"tools": WEATHER, "tool_choice": "sometimes"}, "tool_choice")]
    for body, message in bad:
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text[:300])
    assert engine.requests_in_flight == 0


@pytest.mark.parametrize("body, param", [
    ({"tools": [*WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {"type": "banana"}}}],
      "tool_choice": {"type": "function", "function": {"name": "bad"}}}, "tools.2.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "banana"}}}],
      "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"type": "banana"}}}, "structured_outputs.json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
])
def test_a_constraint_that_does_not_compile_names_the_field_it_came_from(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    assert r.json()["error"]["message"].startswith(f"invalid {param}: "), r.text[:300]
