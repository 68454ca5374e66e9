"""Which JSON-schema keywords the grammar compiler (xgrammar) does not enforce.

xgrammar compiles most of JSON Schema into a grammar, but a few keywords it accepts and then leaves
out: the grammar allows outputs that break them (``[1, 1]`` under ``uniqueItems``, ``4`` under
``"not": {"enum": [4]}``, a 4-character string under ``allOf: [{"type": "string"}, {"maxLength":
3}]``), and it resolves no ``$ref`` but a local JSON pointer. A request whose schema holds one of
them would get a 200 with an answer its own schema refuses, so it is refused instead (a 400 naming
the keyword and where it is), as OpenAI's strict mode refuses keywords it does not support and vLLM
refuses them for its xgrammar backend. tests/llm_core/engine/test_schema_support.py checks each entry
against the pinned xgrammar: the grammar of a schema with it accepts an output that breaks it (so an
xgrammar that learns one fails the test, and the entry can go).
"""

from __future__ import annotations

from typing import Any, Mapping

# keyword -> why (the words of the 400); a keyword is refused wherever it sits in the schema
UNENFORCED: dict[str, str] = {
    "not": "negated schemas are not enforced",
    "if": "conditional schemas are not enforced", "then": "conditional schemas are not enforced",
    "else": "conditional schemas are not enforced",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
    "contains": "contains is not enforced", "minContains": "contains is not enforced",
    "maxContains": "contains is not enforced",
    "$recursiveRef": "only local $ref pointers are resolved", "$dynamicRef": "only local $ref pointers are resolved",
}
# how a schema walk tells schemas from data (here, and where tool schemas are re-rooted: prompt/tool_calls.py)
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # names -> schemas
VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # data, not schemas


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of ``schema`` (parsed JSON) the compiler would not enforce, as
    "KEYWORD at POINTER: why", or None when it enforces them all."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, at = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{at}/{i}") for i, v in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, Mapping):
            continue
        for key, value in node.items():
            where = f"{at}/{_escaped(key)}"
            problem = _problem(key, value)
            if problem is not None:
                return f"{key} at {at}: {problem}"
            if key in SCHEMA_MAPS and isinstance(value, Mapping):  # names -> schemas (a property may be named "not")
                stack.extend((sub, f"{where}/{_escaped(name)}") for name, sub in value.items())
            elif key not in VALUE_KEYWORDS:
                stack.append((value, where))
    return None


def _problem(key: str, value: Any) -> str | None:
    if key in UNENFORCED:
        return UNENFORCED[key]
    if key == "uniqueItems" and value is True:
        return "unique items are not enforced"
    if key == "allOf" and isinstance(value, list) and len(value) > 1:
        return "an allOf of more than one schema is not enforced (merge them into one)"
    if key == "$ref" and isinstance(value, str) and value != "#" and not value.startswith("#/"):
        return f"only local $ref pointers (#/...) are resolved, not {value[:80]!r}"
    return None


def _escaped(name: Any) -> str:
    """A JSON pointer's reference token (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")
