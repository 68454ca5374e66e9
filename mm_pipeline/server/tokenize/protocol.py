"""Request bodies of vLLM's utility endpoints ``POST /tokenize`` and ``POST /detokenize``
(routes.py), on the chat endpoint's models (server/protocol.py): the chat form of /tokenize
takes the same messages and template fields, refused alike."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from mm_pipeline.server.completions.sampling_fields import check_unsupported
from mm_pipeline.server.message_protocol import ChatMessage, _Loose
from mm_pipeline.server.protocol import _NOT_IMPLEMENTED_CHAT, ChatTemplateFields

# the chat form of /tokenize: what /v1/chat/completions refuses, refused alike (its prompt must be the
# one that endpoint runs); tools are a template field, rendered as there
_NOT_IMPLEMENTED_TOKENIZE_CHAT: dict[str, tuple[Any, ...]] = {
    k: v for k, v in _NOT_IMPLEMENTED_CHAT.items() if k != "echo"}
# chat-only fields that the text form would otherwise silently ignore: their values there
_CHAT_ONLY = {"add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": None,
              "tools": None}


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize`` in vLLM's two forms: ``prompt`` (a text, tokenized as is) or ``messages``
    (a chat, templated as /v1/chat/completions templates it, with the same template fields)."""

    model: str | None = None
    prompt: str | None = Field(default=None, description="the text form: tokenized without a chat template")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, fail_fast=True, description=(
        "the chat form: the prompt ids /v1/chat/completions would run for these messages"))
    add_special_tokens: bool | None = Field(default=None, description=(
        "text form: add the tokenizer's special tokens around the text (default true, as vLLM); "
        "chat form: false only (the template writes them)"))
    return_token_strs: bool = Field(default=False, description="also answer each token as its string")

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported_chat(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("messages") is not None:
            check_unsupported(values, _NOT_IMPLEMENTED_TOKENIZE_CHAT)
        return values

    @model_validator(mode="after")
    def _one_form(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (a text) and messages (a chat)")
        if self.prompt is not None:
            for name, value in _CHAT_ONLY.items():
                given = getattr(self, name)
                if given != value and not (name in ("chat_template_kwargs", "tools") and not given):
                    raise ValueError(f"{name} applies to the chat form (messages) only")
        return self

    @property
    def special_tokens(self) -> bool:
        """``add_special_tokens`` with its default for the form (text: true, chat: false)."""
        if self.add_special_tokens is None:
            return self.messages is None
        return self.add_special_tokens


class DetokenizeRequest(_Loose):
    """``POST /detokenize``: token ids back to text (special tokens kept). Ids are checked against the
    tokenizer's vocabulary and the count against the context limit by the route."""

    model: str | None = None
    tokens: list[Annotated[int, Field(strict=True)]] = Field(description="token ids (integers)")
