"""What the engine hands back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class ErrorKind(str, Enum):
    """Why the engine ended a request with finish_reason "error": the failures the text engine can
    tell apart. The values are the wire names. Layers above add kinds of their own beside these
    (media, overload), which is why outputs carry the kind as a plain ``str``."""

    INVALID_INPUT = "invalid_input"  # empty prompt, token ids outside the vocabulary
    CONTEXT_LENGTH = "context_length"  # no room to generate within max_model_len, or too big for the KV pools
    INTERNAL = "internal"  # a model step raised: a bug or a device failure, not the caller's doing


@dataclass(frozen=True)
class RequestError:
    """A typed reason a request cannot be served (``LLMEngine.check_prompt``)."""

    kind: ErrorKind
    message: str


@dataclass
class RequestOutput:
    """State of one request after a step (cumulative), plus what this step added.

    ``finish_reason``: None while running, else "stop" (EOS, stop token or stop string), "length"
    (max_tokens or the context limit), "error" (``error`` says why in words, ``error_kind`` which
    kind of failure it is; the pools are left as if the request never came) or "abort".
    ``logprobs``: the chosen token's logprob per generated token (None unless requested);
    ``top_logprobs``: per generated token, {token_id: logprob} of the top-n (n = params.logprobs).
    ``prompt_logprobs`` (params.prompt_logprobs): per prompt token its logprob given the tokens
    before it (None for the first), ``prompt_logprob_ranks`` its rank (1 = the likeliest; 0 for
    the first) and ``prompt_top_logprobs`` the top-n; set once every prompt token has one (from the
    output with the first token on), None before and when not asked for. Shared, not copied: do
    not change them.
    ``text``: the final output text (cut before a matched stop string), set once the request finished
    on an engine with a tokenizer -- "" is real text (nothing before the stop string, no output, or a
    decode that failed); None means it was not decoded (still running, or no tokenizer), and a
    consumer decodes the tokens itself.
    ``num_cached_tokens``: prompt tokens the prefix cache supplied when the request was first
    admitted (vLLM's meaning, reported as usage.prompt_tokens_details.cached_tokens): never more than
    the prompt, and a re-admission after a preemption does not change it.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None: not decoded (see above)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_logprob_ranks: list[int] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None  # an ErrorKind value when finish_reason == "error"
    num_cached_tokens: int = 0
