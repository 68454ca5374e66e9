"""How a chat or completion request asks for structured outputs, as the three APIs spell it:
OpenAI's ``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` (json, regex,
choice, grammar) and vLLM's older ``guided_*`` fields; one of them per request, turned into the
engine's ``StructuredOutputsParams`` (sampling_fields.py holds the request fields that carry them)."""

from __future__ import annotations

import dataclasses

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llm_core.engine.structured.params import MAX_CHOICES, StructuredOutputsParams
from mm_pipeline.server.message_protocol import _Loose


class JsonSchemaFormat(_Loose):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced here, strict or not


class ResponseFormat(_Loose):
    """OpenAI's ``response_format``: text (no constraint), json_object or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema")
        return self


class StructuredOutputsFields(BaseModel):
    """vLLM's ``structured_outputs`` request field (an unknown key is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    grammar: str | None = None
    disable_any_whitespace: bool = False


def structured_outputs_of(values: Any) -> StructuredOutputsParams | None:
    """The one constraint of a request (sampling_fields.SamplingFields: ``response_format``,
    ``structured_outputs`` or a ``guided_*`` field), or None; a ValueError when it names more than one or the constraint is malformed."""
    sources: dict[str, StructuredOutputsParams] = {}
    fmt = values.response_format
    if fmt is not None and fmt.type == "json_object":
        sources["response_format"] = StructuredOutputsParams(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        sources["response_format"] = StructuredOutputsParams(json=fmt.json_schema.schema_,
                                                             source="response_format.json_schema.schema")
    so = values.structured_outputs
    if so is not None:
        given = StructuredOutputsParams(
            json=so.json_, json_object=bool(so.json_object), regex=so.regex,
            choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar,
            disable_any_whitespace=so.disable_any_whitespace)
        sources["structured_outputs"] = dataclasses.replace(given, source=f"structured_outputs.{given.kind}")
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(values, name)
        if value is not None:
            sources[name] = StructuredOutputsParams(**{kind: tuple(value) if kind == "choice" else value}, source=name)
    if len(sources) > 1:
        raise ValueError(f"give one structured output constraint, got {' and '.join(sources)}")
    return next(iter(sources.values()), None)
