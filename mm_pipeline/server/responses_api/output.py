"""The response object of the Responses API and its output items, built from the chat answer a
request was answered as (routes.py; streamed: events.py builds the same items as they arrive).

    output: [reasoning {content: [reasoning_text]}]   the thinking (--reasoning-parser), when any
            [message {content: [output_text {text, annotations: [], logprobs}]}]
                                                      the answer's text; left out when the answer is
                                                      only tool calls
            [function_call {call_id, name, arguments}] one per call the model made (--tool-call-parser)
    status: completed; incomplete ({"reason": "max_output_tokens"}) when the token limit cut it, and
            so is the item it cut (response_of_chat); the others are completed. A background
            response (background.py) is queued, then in_progress, and may end failed or cancelled
    usage:  input_tokens (cached_tokens: the prefix cache's hits), output_tokens (reasoning_tokens:
            the thinking's), total_tokens
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, Field

from llm_core.engine.sampling.generation_config import GenerationDefaults
from mm_pipeline.server.responses import ChatCompletion, TokenLogprob, Usage
from mm_pipeline.server.responses_api.protocol import ResponsesRequest


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)  # filled when the request asked for them


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_item_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningOutput(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_item_id("rs"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list[Any] = Field(default_factory=list)  # no summaries: the thinking itself is the content
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_item_id("fc"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    call_id: str
    name: str
    arguments: str = ""

    @classmethod
    def of_chat(cls, call: dict[str, Any]) -> "FunctionCallOutput":
        """From a chat answer's tool call ``{"id", "type", "function": {"name", "arguments"}}``."""
        return cls(call_id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])


OutputItem = Union[ReasoningOutput, OutputMessage, FunctionCallOutput]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # OpenAI's explicit cache writes: none here (the prefix cache is automatic)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    @classmethod
    def of_chat(cls, u: Usage) -> "ResponseUsage":
        thinking = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0
        return cls(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=thinking))


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """OpenAI's ``response``: the answer, and the request's settings echoed."""

    id: str = Field(default_factory=lambda: new_item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=dict)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool = False

    @classmethod
    def of_request(cls, req: ResponsesRequest, model: str, store: bool,
                   defaults: GenerationDefaults = GenerationDefaults()) -> "ResponseObject":
        """An in-progress response of ``req`` (nothing answered yet); ``store``: whether it will be
        kept; ``defaults``: the sampling a field left unset gets (echoed as used, as OpenAI does)."""
        choice = req.tool_choice
        text = {"format": req.text.format.echoed(), **req.text.model_dump(include={"verbosity"}, exclude_none=True)}
        return cls(model=model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                   previous_response_id=req.previous_response_id, temperature=defaults.temperature if req.temperature is None else req.temperature,
                   top_p=defaults.top_p if req.top_p is None else req.top_p,
                   top_logprobs=req.top_logprobs, tools=[t.model_dump(exclude_none=True) for t in req.tools],
                   tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
                   parallel_tool_calls=req.parallel_tool_calls, text=text,
                   reasoning=None if req.reasoning is None else req.reasoning.model_dump(),
                   store=store, metadata=dict(req.metadata or {}), user=req.user, service_tier=req.service_tier,
                   prompt_cache_key=req.prompt_cache_key, safety_identifier=req.safety_identifier,
                   background=req.background, status="queued" if req.background else "in_progress")

    def finish(self, finish_reason: str | None, usage: Usage) -> None:
        """Set the end state: incomplete when the token limit cut the answer, else completed. The
        items keep their own statuses (response_of_chat's, or as the stream announced them)."""
        self.usage = ResponseUsage.of_chat(usage)
        if finish_reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"

    def fail(self, code: str, message: str) -> None:
        """Set the end state of an answer that failed after it started (nothing to answer with an HTTP error)."""
        self.status, self.error = "failed", ResponseError(code=code, message=message)

    def answer_message(self) -> dict[str, Any]:
        """The output as the chat's assistant message (a later response's history): the text of
        every message item and the thinking of every reasoning item joined, in order, and the calls."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for item in self.output:
            if isinstance(item, ReasoningOutput):
                message["reasoning_content"] = message.get("reasoning_content", "") + "".join(
                    c.text for c in item.content)
            elif isinstance(item, OutputMessage):
                message["content"] = (message["content"] or "") + "".join(c.text for c in item.content)
            else:
                message.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": item.arguments}})
        if message["content"] is None and "tool_calls" not in message:
            message["content"] = ""
        return message


def response_of_chat(response: ResponseObject, chat: ChatCompletion) -> ResponseObject:
    """Fill ``response`` (of_request's) with a non-streamed chat answer (one choice). When the token
    limit cut it, the item it cut is ``incomplete``: the message (text runs to the end: events.py),
    else the thinking, and then no message follows it (as OpenAI answers); calls are whole or none."""
    choice = chat.choices[0]
    message = choice.message
    cut = "incomplete" if choice.finish_reason == "length" else "completed"
    thinking_cut = bool(message.reasoning_content) and not message.content and not message.tool_calls \
        and cut == "incomplete"
    if message.reasoning_content:
        response.output.append(ReasoningOutput(status="incomplete" if thinking_cut else "completed",
                                               content=[ReasoningText(text=message.reasoning_content)]))
    if message.content or not (message.tool_calls or thinking_cut):
        logprobs = choice.logprobs.content if choice.logprobs is not None else []
        response.output.append(OutputMessage(status=cut, content=[OutputText(text=message.content or "",
                                                                              logprobs=logprobs)]))
    response.output.extend(FunctionCallOutput.of_chat(c) for c in message.tool_calls or ())
    response.finish(choice.finish_reason, chat.usage)
    return response
