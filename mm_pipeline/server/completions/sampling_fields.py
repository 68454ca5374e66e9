"""The fields chat and text completions share (``SamplingFields``, the base of both request models
in protocol.py): how to sample, when to stop, how to stream, which structured output constraint
(completions/structured_formats.py), the client's request id; each with its bounds.
``defaults_problem`` holds a server's sampling defaults to the same bounds, since a request that
leaves a field unset gets the default.

A field that would change the answer in a way we do not implement is refused by name unless it holds
its no-op value (``refusing``): this module's table for the fields every completion shares, the chat
and text completion requests' own tables in protocol.py, and the bodies built on them (/tokenize,
the Responses API) refuse alike.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator

from llm_core.engine.queue_policy import PRIORITY_LIMIT
from llm_core.kvcache.page_keys import MAX_CACHE_SALT_CHARS
from llm_core.engine.sampling.params import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_INT32,
                                      MAX_LOGIT_BIAS, MAX_LOGPROBS, SEED_LIMIT)
from llm_core.engine.structured.params import MAX_CHOICES, StructuredOutputsParams
from mm_pipeline.server.completions.structured_formats import ResponseFormat, StructuredOutputsFields, structured_outputs_of
from mm_pipeline.server.message_protocol import _Loose
from mm_pipeline.server.request_id import MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN

# Every sampling field is bounded here, so a value the engine cannot turn into a tensor or a
# generator seed is a 400 naming the field, never an exception inside a shared model step.
MAX_N = 16
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters of one stop sequence: each is matched against the text every token
MAX_STOP_TOKEN_IDS = 64

TokenCount = Annotated[int, Field(ge=1, le=MAX_INT32)]
# a client's id for its request (vLLM's request_id field, or the X-Request-Id header): printable
# ASCII without spaces, so it can go into a response header and a log line as it is
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class StreamOptions(_Loose):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description=(
        "vLLM's: with include_usage, every chunk carries the usage so far (prompt, and completion tokens "
        "generated up to that chunk)"))


# field -> the values that leave the answer as if the field were absent (None always does). Any other
# value is a 400 naming the field: each would change the answer in a way this server does not do.
_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],), "function_call": ("none", "auto"),
    "audio": (), "modalities": (["text"],), "web_search_options": (), "reasoning_effort": (), "verbosity": (),
    # vLLM's extensions (their no-op values are vLLM's defaults)
    "length_penalty": (1,),
    "use_beam_search": (False,), "logits_processors": (),
    "structural_tag": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
"spaces_between_special_tokens": (True,),
}


def check_unsupported(values: dict[str, Any], table: dict[str, tuple[Any, ...]]) -> None:
    for name, no_op in table.items():
        value = values.get(name)
        if value is not None and value not in no_op:
            shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
            accepted = f"; accepted: {' or '.join(map(repr, no_op))}" if no_op else ""
            raise ValueError(f"{name} is not supported by this server (got {shown}{accepted})")


def refusing(table: dict[str, tuple[Any, ...]]) -> Any:
    """A model's before-validator that refuses ``table``'s fields (``check_unsupported``): looked
    for before the fields are validated, so the 400 names them however the rest of the body looks.
    In a model body: ``_refuse = refusing(TABLE)``."""

    def refuse(cls: type, values: Any) -> Any:
        if isinstance(values, dict):
            check_unsupported(values, table)
        return values

    return model_validator(mode="before")(classmethod(refuse))


class SamplingFields(_Loose):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    # any int64 (clients send negative seeds too); the engine seeds with it modulo 2**63
    seed: int | None = Field(default=None, ge=-SEED_LIMIT, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens in the text
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string it matched
    # OpenAI's penalties and logit_bias, vLLM's min_p / min_tokens / repetition_penalty (SamplingParams)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    # token id (a decimal string, as JSON keys are) -> bias; ids outside the vocabulary: the engine's 400
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT32)
    # vLLM's: only these ids / never these words (SamplingParams: ids past the vocabulary, the engine's 400)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS)
    n: int = Field(default=1, ge=1, le=MAX_N)
    # vLLM's: each prompt token's logprob given the ones before it, with the top n (the prompt is
    # computed whole: no prefix-cache hit); answered once, so not with stream
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: logprob entries name tokens "token_id:<id>" (None: the server's
    # --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds); a prompt with
    # media that would be cut is a 400
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    # vLLM's: lower is served first under --queue-policy priority; any other value than 0 is a 400
    # under the other policies (the engine's check_priority)
    priority: int = Field(default=0, ge=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)
    # vLLM's: the prefix cache shares KV only between requests of the same salt (a tenant's secret)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: the answer's id is <chatcmpl|cmpl>-<request_id> (an X-Request-Id header wins over it)
    request_id: RequestId | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured outputs (one constraint per request; completions/structured_formats.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None

    _reject_unsupported = refusing(_NOT_IMPLEMENTED)

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "SamplingFields":
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true (as in vLLM)")
        if self.stream_options is not None and not self.stream:  # OpenAI's and vLLM's 400 too
            raise ValueError("stream_options is only allowed with stream: true")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> "SamplingFields":
        self.structured_outputs_params  # noqa: B018  (built for its checks: a 400 naming the field)
        return self

    @property
    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The engine's form of the request's structured output constraint (None: unconstrained)."""
        return structured_outputs_of(self)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's ``continuous_usage_stats``, with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)



def defaults_problem(defaults: Any) -> str | None:
    """Why a server cannot take these sampling defaults (a ``GenerationDefaults``: the checkpoint's
    generation config and ``--override-generation-config``), or None: each must be a value a request
    may ask for itself (``SamplingFields``' ranges), since a request that leaves the field unset gets
    it. A ``temperature`` of 5 is a valid engine setting but no request may send it, so every request
    without one was sampled at 5."""
    given = {"max_tokens": defaults.max_tokens, "temperature": defaults.temperature, "top_p": defaults.top_p,
             "top_k": defaults.top_k, "min_p": defaults.min_p, "repetition_penalty": defaults.repetition_penalty}
    try:
        SamplingFields.model_validate({k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        name = {"max_tokens": "max_new_tokens"}.get(str(first["loc"][0]), str(first["loc"][0]))
        return (f"the sampling default {name} {first.get('input')!r} (from {defaults.origin_of(name)}) is not a "
                f"value a request may send: {first['loc'][0]}: {first['msg'].removeprefix('Value error, ')}")
    return None
