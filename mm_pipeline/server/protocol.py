"""Request models of the OpenAI-compatible API (the subset mmserve serves; a chat's messages and
their parts: message_protocol.py; responses: responses.py).

Requests validate what the engine needs. A field that would change the answer in a way we do not
implement (``functions``, ``best_of`` > ``n``, ``chat_template``...:
the ``_NOT_IMPLEMENTED`` tables) is rejected with a 400 that names it instead of being silently ignored,
unless it holds its no-op value. vLLM's chat-template fields ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs`` are honoured (``TemplateOptions``,
prompt/template_options.py, carried to the prompt layout on the parsed chat), and so are ``tools``
(rendered by the chat template, with the same bounds) and ``tool_choice`` (``"none"``, ``"auto"``;
``"required"`` and a named function force the calls as JSON under a grammar). Structured outputs come as OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (json, regex,
choice, grammar) or vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``: one of them per request (``StructuredOutputsParams``). The fields chat and text
completions share, with their bounds and refusals: completions/sampling_fields.py. Other unknown fields
are ignored, as vLLM ignores them: metadata that does not change the answer (``user``,
``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
``prediction``...). vLLM's ``priority`` is honoured under ``--queue-policy
priority`` and must be 0 otherwise (a 400, as vLLM answers).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, RootModel, Tag, field_validator, model_validator

from llm_core.engine.sampling.params import MAX_LOGPROBS
from llm_core.engine.structured.params import StructuredOutputsParams
from mm_pipeline.errors import InvalidMessageError
from mm_pipeline.prompt.template_options import TemplateOptions, check_template_kwargs, check_tools
from mm_pipeline.prompt.tool_calls import forced_call_schema, in_tool_terms
from mm_pipeline.server.completions.sampling_fields import MAX_N, SamplingFields, TokenCount, TokenId, refusing
from mm_pipeline.server.completions.structured_formats import structured_outputs_of
from mm_pipeline.server.message_protocol import ChatMessage, _Loose

# chat only: what the prompt layout cannot do (README "Serving (OpenAI-compatible)"): a template of
# the client's, RAG documents (the server passes none: ChatTemplate reserves the name), processor
# arguments, echo. add_generation_prompt, continue_final_message and chat_template_kwargs are
# fields (ChatTemplateFields -> TemplateOptions)
# text completions: no chat template to render tools with (chat: ChatTemplateFields.tools)
_NOT_IMPLEMENTED_COMPLETION: dict[str, tuple[Any, ...]] = {"tools": ([],), "tool_choice": ("none", "auto")}
_NOT_IMPLEMENTED_CHAT: dict[str, tuple[Any, ...]] = {
    "chat_template": (), "documents": (), "mm_processor_kwargs": ({},), "echo": (False,),
    "add_special_tokens": (False,),
}


class ChatTemplateFields(_Loose):
    """vLLM's chat-template fields, with vLLM's defaults (prompt/template_options.py): shared by
    /v1/chat/completions and the chat form of /tokenize, which template a chat alike."""

    add_generation_prompt: bool = Field(default=True, description="end the prompt with the assistant header")
    continue_final_message: bool = Field(default=False, description=(
        "the final message is an assistant message the model goes on writing (needs add_generation_prompt: false)"))
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description=(
        "variables for the chat template (e.g. enable_thinking); a key it does not read, or one the server "
        "sets itself, is a 400"))

    tools: list[Any] | None = Field(default=None, description=(
        "OpenAI function definitions, rendered by the chat template (at most 128, 256 KiB of JSON)"))

    @field_validator("tools")
    @classmethod
    def _bounded_tools(cls, v: list[Any] | None) -> list[Any] | None:
        try:
            return None if v is None else list(check_tools(v))
        except InvalidMessageError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            return None if v is None else check_template_kwargs(v)
        except InvalidMessageError as exc:  # a 400 naming the key, as for any other field
            raise ValueError(str(exc).removeprefix("chat_template_kwargs").lstrip(" .:")) from None

    @model_validator(mode="after")
    def _template_flags(self) -> "ChatTemplateFields":
        # continue_final_message with add_generation_prompt (true by default): a 400 here, as in vLLM
        try:
            self.template_options  # noqa: B018  (built for its checks)
        except InvalidMessageError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def template_options(self) -> TemplateOptions:
        """How the prompt layout templates this chat (its kwargs checked again: microseconds)."""
        return TemplateOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {},
                               tuple(self.tools or ()))


class NamedFunction(_Loose):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Loose):
    """OpenAI's ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction



class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    # fail_fast: a list of a million bad items is one error (the first), not a million
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(default=None, description=(
        "none: tools are rendered, the answer is not parsed for calls; auto (the default with tools): calls "
        "are parsed into tool_calls; required or {\"type\": \"function\", \"function\": {\"name\": ...}}: "
        "the answer is forced to be calls (JSON under a grammar, as vLLM does)"))
    parallel_tool_calls: bool = Field(default=True, description=(
        "false: at most one call per answer (required: the grammar allows one; auto: the first parsed call)"))

    @model_validator(mode="after")
    def _forced_calls(self) -> "ChatCompletionRequest":
        if self.tool_choice in (None, "none", "auto"):
            return self
        if not self.tools:
            raise ValueError("tool_choice \"required\" or a named function needs tools")
        if structured_outputs_of(self) is not None:
            raise ValueError("give one structured output constraint, got tool_choice and a response format")
        try:
            self.structured_outputs_params  # noqa: B018  (the forced calls' schema, built for its checks)
        except ValueError as exc:
            raise ValueError(f"tool_choice: {exc}") from None
        return self

    @property
    def forced_function(self) -> str | None:
        """The function a named tool_choice forces (None otherwise)."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def forces_tool_calls(self) -> bool:
        """Whether tool_choice forces the answer to be calls ("required" or a named function)."""
        return self.tool_choice == "required" or self.forced_function is not None

    @property
    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        if self.forces_tool_calls:  # compact JSON: arguments are read by a program, not a person
            try:
                return StructuredOutputsParams(json=forced_call_schema(self.tools or (), self.forced_function,
                                                                       self.parallel_tool_calls),
                                               disable_any_whitespace=True, source=self._forced_source)
            except ValueError as exc:  # a place in "required"'s array schema, named in the tool's own
                raise ValueError(in_tool_terms(str(exc))) from None
        return structured_outputs_of(self)

    @property
    def _forced_source(self) -> str:
        """Where the forced calls' schema comes from: the named function's parameters, or the tools."""
        names = [t.get("function", {}).get("name") for t in self.tools or ()]
        if self.forced_function in names:
            return f"tools.{names.index(self.forced_function)}.function.parameters"
        return "tools"

    @property
    def parse_tool_calls(self) -> bool:
        """Whether the answer is parsed for the model's own tool calls: tools given and tool_choice
        "auto" (or absent)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    _reject_unsupported_chat = refusing(_NOT_IMPLEMENTED_CHAT)

    @model_validator(mode="after")
    def _logprob_pair(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_n(self) -> int | None:
        """The engine's ``logprobs`` setting: None = off, k = chosen token plus the top k."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    # fail_fast: a list of bad items is one error per form it could be, not one per item and form
    prompt: (str | Annotated[list[str], Field(fail_fast=True)] | Annotated[list[TokenId], Field(fail_fast=True)]
             | Annotated[list[list[TokenId]], Field(fail_fast=True)])
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    _reject_unsupported_completion = refusing(_NOT_IMPLEMENTED_COMPLETION)

    @model_validator(mode="after")
    def _checks(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


def _invocation_kind(body: Any) -> str | None:
    if isinstance(body, dict):
        return "chat" if "messages" in body else "completion" if "prompt" in body else None
    return None


class Invocation(RootModel[Annotated[Union[Annotated[ChatCompletionRequest, Tag("chat")],
                                          Annotated[CompletionRequest, Tag("completion")]],
                                    Discriminator(_invocation_kind, custom_error_type="invocation",
                                                  custom_error_message="an invocation is a chat request "
                                                  "(messages) or a completion request (prompt)")]]):
    """SageMaker's ``POST /invocations`` body: a chat or a completion request, told apart by its
    ``messages`` or ``prompt`` (as vLLM's server tells them apart)."""
