"""The object bound of a JSON body (``max_json_objects``, json_limits.py) and the first-error-only
validation of long lists (pydantic's ``fail_fast``): a body of many objects is refused before
pydantic builds a model for each (each a GIL-held build and garbage the collector walks with every
thread stopped), braces inside strings are not objects, and a list of many bad items is one error,
not one per item (``errors()`` of a million errors took ~4 s with the GIL held)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from mm_pipeline.server import ServerSettings, create_app
from mm_pipeline.server.batches.validation import validate_file
from mm_pipeline.server.json_limits import JSONLimits, json_objects
from mm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest
from mm_pipeline.server.responses_api.protocol import ResponsesRequest
from tests.mm_pipeline.server.test_error_statuses import CHAT, ScriptedEngine
from tests.support.batches import URL, line, upload

# strings full of what a brace counter could trip on: braces, quotes, backslashes, escapes
_TRICKY = st.text(alphabet=st.sampled_from(list('{}[]",:\\ab\n\u00e9\U0001f600')), max_size=12)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TRICKY,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
                     max_leaves=30)


def _dicts(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(_dicts(v) for v in value.values())
    if isinstance(value, list):
        return sum(_dicts(v) for v in value)
    return 0


@settings(max_examples=400, deadline=None)
@given(_JSON, st.booleans(), st.integers(min_value=1, max_value=8), st.integers(min_value=1, max_value=9))
def test_the_exact_count_is_the_objects_whatever_the_strings_hold(value, ascii_only, stop, window):
    """Braces, quotes and escaped quotes inside strings (keys too) are not objects; the count stops
    at ``stop``; the text is counted a window at a time and no window boundary changes the count
    (one inside a run of backslashes, between a backslash and the quote it escapes)."""
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_objects(raw, 10_000) == _dicts(value)
    assert json_objects(raw, stop) == min(_dicts(value), stop)
    assert json_objects(raw, 10_000, window_bytes=window) == _dicts(value)


def test_a_run_of_backslashes_across_a_window_boundary_keeps_its_parity():
    """At the real window size (1 MB): a run of backslashes ending just before, at and across the
    first window's end, before the closing quote (even runs) or an escaped one (odd runs)."""
    window = 1 << 20
    for run in range(window - 12, window - 4):
        closes = b'{"a": "' + b"\\" * (2 * (run // 2)) + b'", "b": {}}'  # an even run: the quote closes
        assert json_objects(closes, 10) == 2
        escaped = b'{"a": "' + b"\\" * (2 * (run // 2) + 1) + b'"{{", "b": {}}'  # odd: the quote is text
        assert json_objects(escaped, 10) == 2


def test_a_text_over_the_cap_only_by_braces_in_strings_is_within_it():
    limits = JSONLimits(1 << 30, 1 << 30, max_objects=1024)
    code = json.dumps({"messages": [{"role": "user", "content": "if (x) { y(); }" * 5000}]})
    assert limits.objects_problem(code, "request body") is None  # 5,000 braces, 2 objects
    many = json.dumps({"messages": [{"role": "user", "content": "a"}] * 1024})
    assert limits.objects_problem(many, "request body") == (
        "request body holds more than 1024 JSON objects (max_json_objects)")
    assert limits.objects_problem(many.encode(), "line 3") == "line 3 holds more than 1024 JSON objects (max_json_objects)"
    assert limits.objects_problem(many[:-3], "request body") is not None  # cut inside: still counted
    assert limits.objects_problem('{"a": "never ends' + "{" * 2000, "x") is None  # the parser reports it


@pytest.fixture()
def server(tmp_path):
    engine = ScriptedEngine()
    settings_ = ServerSettings(files_dir=str(tmp_path), max_json_objects=2048)
    with TestClient(create_app(engine, settings_), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 2049}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2048}]}),
    ("/v1/completions", {"model": "m", "prompt": [{}] * 3000}),
    ("/invocations", {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 2049}),
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": "hi"}] * 2049}),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 2049}),
])
def test_a_body_of_more_objects_than_the_cap_is_a_413_naming_it(server, path, body):
    r = server.post(path, json=body)
    assert r.status_code == 413, r.text
    assert "more than 2048 JSON objects (max_json_objects)" in r.json()["error"]["message"]


def test_a_body_within_the_cap_is_answered_even_when_its_strings_hold_many_braces(server):
    at_cap = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 2047}  # + the body itself
    assert server.post("/v1/chat/completions", json=at_cap).status_code == 200
    code = {**CHAT, "messages": [{"role": "user", "content": "int f() { return g({}); }" * 2000}]}
    assert server.post("/v1/chat/completions", json=code).status_code == 200


def test_a_batch_line_over_the_object_cap_fails_validation_naming_it(store):
    limits = JSONLimits(max_bytes=1 << 20, max_values=1 << 20, max_objects=1024)
    many = line("many", messages=[{"role": "user", "content": "a"}] * 1100)
    path = store.path(upload(store, [line("a"), many]))
    total, errors = validate_file(path, URL, limits)
    assert total == 2 and [(e.line, e.code) for e in errors] == [(2, "too_many_json_objects")]
    assert errors[0].message == "line 2 holds more than 1024 JSON objects (max_json_objects)"


@pytest.mark.parametrize("model,body,where", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}] * 3 + [{}] * 5000}, ("messages", 3)),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}] * 5000}]},
     ("messages", 0, "content")),
    (ResponsesRequest, {"input": [{"role": "user", "content": "a"}, *[{"role": "nobody"}] * 5000]}, ("input",)),
])
def test_a_list_of_many_bad_items_is_one_error_at_the_first(model, body, where):
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps(body))
    errors = info.value.errors()
    # one error (per union branch the value could be), located at the first bad item
    assert 1 <= len(errors) <= 4
    assert any(tuple(e["loc"][:len(where)]) == where for e in errors)


def test_a_completion_prompt_of_many_bad_items_is_one_error_per_form():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": [{}] * 5000}))
    assert info.value.error_count() == 4  # a string, or a list of strings / ids / id lists: the first item each
