"""The body of ``POST /v1/responses`` (OpenAI's Responses API, what ``client.responses.create`` sends);
the chat it is answered as is as_chat.py's.

    input:  a string (one user message) or a list of items:
            message            {"role": user | system | developer | assistant, "content": str | [parts]}
                               ("type": "message" optional); parts: input_text, input_image
                               (image_url or file_id), input_file (file_id or file_data), input_audio;
                               an assistant's: output_text, refusal; and every chat content part as
                               /v1/chat/completions takes it (video_url, audio_url, input_audio_codes, file)
            function_call      {"call_id", "name", "arguments"}  a call the model made earlier
            function_call_output {"call_id", "output"}           its result
            reasoning          {"content": [{"type": "reasoning_text", "text"}]} thinking of the next
                               assistant turn (rendered as its reasoning_content)
    instructions -> a system message first (not carried to a later response, as OpenAI does)
    max_output_tokens, temperature, top_p, top_logprobs, tools (flat function tools), tool_choice,
    parallel_tool_calls, text.format (text | json_object | json_schema), store, previous_response_id,
    metadata, user, and vLLM's sampling extras (``PASSED_FIELDS``) as on /v1/chat/completions.
    background -> answered by a task of the server's, read back by GET (background.py); it needs
                  ``store`` and is not streamed (a 400 naming the combination, before anything runs)

Fields that would change the answer in a way this server does not do are a 400 naming them, not
ignored: ``conversation`` (no Conversations API: chain with ``previous_response_id``), ``prompt`` (no stored
prompt templates), ``truncation: "auto"`` (a prompt over the context is a 400, as on chat), built-in
tools (web search, file search, ...: only ``function`` tools run here), ``include`` values other than
``message.output_text.logprobs``. ``reasoning`` (effort, summary), ``service_tier``,
``prompt_cache_key`` and ``safety_identifier`` are accepted and echoed without effect: the prefix cache
needs no key, and this model's thinking is not steered by an effort.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator,
                      model_validator)

from llm_core.engine.sampling.params import MAX_LOGPROBS
from mm_pipeline.errors import echo
from mm_pipeline.prompt.template_options import MAX_TOOLS
from mm_pipeline.server.completions.sampling_fields import TokenCount, refusing
from mm_pipeline.server.completions.structured_formats import JsonSchemaFormat

# vLLM's sampling extras and this server's request fields, passed to the chat request as given
# (typed and bounded there, by the same definitions as on /v1/chat/completions)
PASSED_FIELDS = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                 "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "bad_words", "allowed_token_ids",
                 "skip_special_tokens", "include_stop_str_in_output", "priority", "cache_salt", "chat_template_kwargs",
                 "return_tokens_as_token_ids", "truncate_prompt_tokens", "structured_outputs")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 and values of 512 characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512

_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "conversation": (), "prompt": (), "truncation": ("disabled",), "max_tool_calls": (),
}


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- input items ------------------------------------------------------------------------------------
class _Item(_Loose):
    id: str | None = Field(default=None, max_length=256)  # an item an earlier response listed keeps its id


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    # the parts are checked where the chat request reads them (message_protocol.ContentPart), after
    # the Responses spellings are turned into the chat's (as_chat.chat_content)
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[dict[str, Any]]


class ReasoningText(_Loose):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")  # an item without a type is a message (EasyInputMessage)
    return getattr(value, "type", "message")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_kind, custom_error_type="input_item",
                                    custom_error_message="input items are messages, function_call, "
                                                         "function_call_output or reasoning")]


# ---- tools and formats --------------------------------------------------------------------------------
class FunctionTool(_Loose):
    """A Responses function tool: flat, where the chat nests it under ``function``."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        fn = {k: v for k, v in (("name", self.name), ("description", self.description),
                                ("parameters", self.parameters), ("strict", self.strict)) if v is not None}
        return {"type": "function", "function": fn}


class NamedFunctionChoice(_Loose):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(JsonSchemaFormat):
    """``text.format``: the chat's ``response_format`` with the json_schema fields flattened in."""

    type: Literal["text", "json_object", "json_schema"] = "text"

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and not self.schema_:
            raise ValueError("text.format of type json_schema needs its schema")
        return self

    def echoed(self) -> dict[str, Any]:
        """As the response object repeats it: the fields of its type only."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.schema_, "strict": self.strict,
                **({"description": self.description} if self.description is not None else {})}

    def as_chat(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_,
                                                       "strict": self.strict, "description": self.description}}


class TextConfig(_Loose):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Loose):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# ---- the request ------------------------------------------------------------------------------------
class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # PASSED_FIELDS are read from the extras; others are ignored

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, fail_fast=True)]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    user: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(default=None, max_length=8)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool = False  # after store and stream: its check reads them

    _reject_unsupported = refusing(_NOT_IMPLEMENTED)

    @field_validator("background")
    @classmethod
    def _background_is_stored_and_polled(cls, v: bool, info: ValidationInfo) -> bool:
        if v and not info.data.get("store", True):
            # as OpenAI: a background response is only ever read back from the store
            raise ValueError("a background response needs store: true (it is read back by GET /v1/responses/{id})")
        if v and info.data.get("stream"):
            # resuming a stream (GET ?stream=true&starting_after=N) is not served, so a background
            # stream would be one the client cannot come back to: refused rather than half done
            raise ValueError("background with stream is not served by this server (nor is resuming a stream): send "
                             "background without stream and poll GET /v1/responses/{id}, or stream without background")
        return v

    @field_validator("input")
    @classmethod
    def _distinct_item_ids(cls, v: str | list[Any]) -> str | list[Any]:
        # GET .../input_items pages by item id (``after``): a repeated one would send a client
        # following the pages back to its first copy forever
        first: dict[str, int] = {}
        for i, item in enumerate(v if isinstance(v, list) else ()):
            if item.id and first.setdefault(item.id, i) != i:  # an empty id is given a fresh one (listed_items)
                raise ValueError(f"input items' ids must differ: item {i} repeats the id {echo(item.id)} of item "
                                 f"{first[item.id]}")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        for tool in v if isinstance(v, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported by this server: only function tools "
                                 f"(the built-in ones run on OpenAI's side)")
        return v

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata keys have at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE}")
        return v

    @field_validator("include")
    @classmethod
    def _known_include(cls, v: list[str] | None) -> list[str] | None:
        for name in v or ():
            if name != LOGPROBS_INCLUDE:
                raise ValueError(f"include {name!r} is not supported by this server (accepted: {LOGPROBS_INCLUDE!r})")
        return v

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries logprobs (``top_logprobs`` or the include asks for them)."""
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())

    def passed(self) -> dict[str, Any]:
        """The chat fields this request passes on as given (``PASSED_FIELDS``)."""
        extra = self.model_extra or {}
        return {k: extra[k] for k in PASSED_FIELDS if k in extra}


# ---- the input as GET /v1/responses/{id}/input_items lists it ------------------------------------
_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(items: str | list[Any]) -> list[dict[str, Any]]:
    """The input as ``GET /v1/responses/{id}/input_items`` lists it: every item with an id (its own,
    or a new one), a message's text as a part (``input_text``; an assistant's ``output_text``)."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        d["id"] = d.get("id") or f"{_ITEM_ID_PREFIX[d['type']]}_{secrets.token_hex(12)}"
        if isinstance(item, MessageItem):
            if isinstance(item.content, str):
                d["content"] = [{"type": "output_text" if item.role == "assistant" else "input_text",
                                 "text": item.content}]
            d.setdefault("status", "completed")
        out.append(d)
    return out
