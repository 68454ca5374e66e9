"""The JSON-schema keywords refused because the grammar compiler does not enforce them
(llm_core/engine/structured/schema_support.py): each entry is checked against the pinned xgrammar
(the grammar of a schema using it accepts an output that breaks it), and schemas without them,
however their properties are named, pass."""

from __future__ import annotations

import json

import pytest

from llm_core.engine.structured.params import StructuredOutputsParams
from llm_core.engine.structured.schema_support import UNENFORCED, unenforced_keyword

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402  (after the skip)

TWO_INTS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# keyword -> (a schema using it, an output it refuses that xgrammar's grammar accepts)
BROKEN = {
    "not": ({"type": "integer", "not": {"enum": [4]}}, 4),
    "if": ({**TWO_INTS, "if": {"properties": {"a": {"const": 1}}, "required": ["a"]}, "then": {"required": ["b"]}},
           {"a": 1}),
    "dependentRequired": ({**TWO_INTS, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({**TWO_INTS, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "dependencies": ({**TWO_INTS, "dependencies": {"a": ["b"]}}, {"a": 1}),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, [2]),
    "maxContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxContains": 1}, [1, 1]),
    "$dynamicRef": ({"$dynamicAnchor": "n", "type": "object", "properties": {"k": {"$dynamicRef": "#n"}}}, {"k": 1}),
    "$recursiveRef": ({"$recursiveAnchor": True, "type": "object", "properties": {"k": {"$recursiveRef": "#"}}},
                      {"k": 1}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "allOf": ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "abcd"),
    "$ref": ({"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "x"),
}


@pytest.mark.parametrize("keyword", sorted(BROKEN))
def test_each_refused_keyword_is_one_xgrammar_lets_an_answer_break(keyword):
    schema, output = BROKEN[keyword]
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, json.dumps(output))  # an xgrammar that enforces it fails here
    found = unenforced_keyword(schema)
    first = {"maxContains": "contains"}.get(keyword, keyword)  # the keyword the walk meets first
    assert found is not None and found.startswith(f"{first} at #"), found
    with pytest.raises(ValueError, match="cannot be held to"):
        StructuredOutputsParams(json=schema)


def test_every_listed_keyword_is_checked():
    assert set(UNENFORCED) - {"then", "else", "minContains"} <= set(BROKEN)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"$ref": "#/$defs/x"}},
     "$defs": {"x": {"type": "string"}}},                                # properties named like keywords
    {"enum": [{"not": 1}, {"$ref": "http://x"}], "default": {"if": 1}},  # keywords inside data
    {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    {"oneOf": [{"type": "integer"}, {"type": "null"}]},
    {"allOf": [{"type": "string", "maxLength": 3}]},                     # one schema: enforced
    {"type": "array", "items": {"$ref": "#"}, "uniqueItems": False},
    {"type": "object", "properties": {"k": {"$ref": "#/$defs/a~1b"}}, "$defs": {"a/b": {"type": "integer"}}},
    True,
])
def test_schemas_the_compiler_enforces_pass(schema):
    assert unenforced_keyword(schema) is None
    StructuredOutputsParams(json=schema)


def test_the_place_is_a_json_pointer():
    schema = {"type": "object", "properties": {"a/b": {"type": "array", "items": [{"type": "integer"}],
                                                       "prefixItems": [{"not": {}}]}}}
    assert unenforced_keyword(schema) == "not at #/properties/a~1b/prefixItems/0: negated schemas are not enforced"
