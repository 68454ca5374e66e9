"""What the engine hands back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """State of one request after a step (cumulative), plus what this step added.

    ``finish_reason``: None while running, else "stop" (EOS, stop token or stop string), "length"
    (max_tokens or the context limit), "error" (``error`` says why; the pools are left as if the
    request never came) or "abort".
    ``logprobs``: the chosen token's logprob per generated token (None unless requested);
    ``top_logprobs``: per generated token, {token_id: logprob} of the top-n (n = params.logprobs).
    ``text`` is filled only when the request finished and the engine has a tokenizer.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
