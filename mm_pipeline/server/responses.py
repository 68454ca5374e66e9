"""Response models of the OpenAI-compatible API (requests: protocol.py)."""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence, TypeVar

from pydantic import BaseModel, Field, model_serializer

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # chat answers with a reasoning parser on: how many completion tokens were thinking (OpenAI's
    # field for reasoning models); the key only then
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _leave_out_no_details(self, handler: Any) -> Any:
        out = handler(self)
        if isinstance(out, dict) and self.completion_tokens_details is None:
            out.pop("completion_tokens_details", None)
        return out

    def add(self, prompt: int, completion: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.prompt_tokens_details.cached_tokens += cached


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs`` (keyed by token id): its logprob, its rank in the
    row's distribution (1 = the likeliest) and its text."""

    logprob: float
    rank: int
    decoded_token: str


def _without_none_prompt_logprobs(out: Any, value: Any) -> Any:
    """vLLM's ``prompt_logprobs`` key only when asked for: other answers keep OpenAI's shape."""
    if isinstance(out, dict) and value is None:
        out.pop("prompt_logprobs", None)
    return out


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""  # null only in an answer of tool calls without other text
    # the answer's thinking (prompt/reasoning.py, --reasoning-parser); null when it has none or the
    # parser is off, as vLLM answers
    reasoning_content: str | None = None
    # the calls parsed out of the answer (prompt/tool_calls.py, --tool-call-parser): OpenAI's
    # [{"id", "type": "function", "function": {"name", "arguments"}}]; the key only when there are any
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _leave_out_no_calls(self, handler: Any) -> Any:
        out = handler(self)
        if isinstance(out, dict) and self.tool_calls is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's: the prompt's logprobs (the same prompt for every choice), when asked for
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _leave_out_prompt_logprobs(self, handler: Any) -> Any:
        return _without_none_prompt_logprobs(handler(self), self.prompt_logprobs)


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # a streamed choice's calls (prompt/tool_calls.py), each whole when its </tool_call> arrives:
    # [{"index", "id", "type": "function", "function": {"name", "arguments"}}]
    tool_calls: list[dict[str, Any]] | None = None

    @classmethod
    def of_text(cls, reasoning: str, content: str) -> "Delta":
        """A chunk's text, thinking and answer (prompt/reasoning.py): a chunk of thinking only has
        no ``content`` key, as vLLM's; any other has it, "" when empty (a chunk that carries only
        logprobs or the finish_reason), as before there was a reasoning parser."""
        if reasoning and not content:
            return cls(reasoning_content=reasoning)
        return cls(content=content, reasoning_content=reasoning or None)

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: Any) -> Any:
        # OpenAI names the role in a choice's first delta only; later deltas leave the key out. A
        # delta without thinking has no reasoning_content key (none at all with the parser off: the
        # chunks are as before), one of thinking only no content key.
        out = handler(self)
        if isinstance(out, dict):
            for key in ("role", "content", "reasoning_content", "tool_calls"):
                if getattr(self, key) is None:
                    out.pop(key, None)
        return out


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    @property
    def end_offset(self) -> int:
        """Where the text after these tokens starts (the running text_offset goes on there)."""
        return self.text_offset[-1] + len(self.tokens[-1]) if self.tokens else 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: this choice's prompt's logprobs, when asked for
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _leave_out_prompt_logprobs(self, handler: Any) -> Any:
        return _without_none_prompt_logprobs(handler(self), self.prompt_logprobs)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    # mmserve extension: blake3 hex of the bytes, the key the media caches use (and the field
    # `mmserve caption` rows carry), so a client can tell two uploads of one file apart from two files
    content_hash: str | None = None


class ListPage(BaseModel):
    """OpenAI's list object around one page of ``data`` (``cursor_page`` fills it)."""

    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileList(ListPage):
    data: list[FileObject]


T = TypeVar("T")


def cursor_page(items: Sequence[T], id_of: Callable[[T], str], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor pagination over ``items`` (in the order the list answers): the ``limit``
    items after the one whose id is ``after`` (none: from the first; an id not in the list: an
    empty page), as a list object's ``data``, ``first_id``, ``last_id`` and ``has_more``."""
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if id_of(item) == after), len(items))
    page = list(items[start:start + limit])
    return {"data": page, "first_id": id_of(page[0]) if page else None, "last_id": id_of(page[-1]) if page else None,
            "has_more": start + limit < len(items)}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mmserve"
    # vLLM's additions, which clients read to size their prompts: the served name again (no path of
    # the server's) and the longest prompt + output one request can hold (null when unknown)
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    kind: str | None = None  # the pipeline's error kind (mm_pipeline/errors.py), when it has one


class ErrorResponse(BaseModel):
    """Every error body (mm_pipeline/server/errors.py), documented in the OpenAPI schema."""

    error: ErrorDetail


class TokenizeResponse(BaseModel):
    """``POST /tokenize`` (vLLM's shape): ``token_strs`` is null unless ``return_token_strs``."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
