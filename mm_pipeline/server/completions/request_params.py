"""What a request's fields become for the engine: the answer's id and its engine requests' ids
(``request_ids``), each choice's ``SamplingParams`` (``sampling_params``: the request's values, else
the model's generation config, else the built-in defaults), and its messages parsed
(``parsed_messages``, off the event loop when long). Shared by every route ChatService answers and
by /tokenize."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Union

from llm_core.engine.sampling.generation_config import GenerationDefaults
from llm_core.engine.sampling.params import SEED_LIMIT, SamplingParams
from mm_pipeline.errors import InvalidInputError
from mm_pipeline.prompt.messages import ParsedMessages
from mm_pipeline.prompt.reasoning import ThinkSyntax
from mm_pipeline.server.completions.sampling_fields import SamplingFields
from mm_pipeline.server.protocol import ChatCompletionRequest
from mm_pipeline.server.tokenize.protocol import TokenizeRequest

# a request holding a chat: /v1/chat/completions, or /tokenize's chat form (its messages then set)
ChatRequestFields = Union[ChatCompletionRequest, TokenizeRequest]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def request_ids(prefix: str, given: str | None) -> tuple[str, str]:
    """(the answer's id, the base of its engine requests' ids). A client's id (``X-Request-Id`` or
    the ``request_id`` field, vLLM's) names the answer, ``<prefix>-<given>``; its engine requests get
    a random suffix as well, so two clients sending the same id never collide in the engine."""
    if given is None:
        rid = new_id(prefix)
        return rid, rid
    rid = f"{prefix}-{given}"
    return rid, f"{rid}-{secrets.token_hex(4)}"


def sampling_params(req: SamplingFields, logprobs: int | None, choice: int, default_max_tokens: int | None,
                    reasoning: ThinkSyntax | None = None, prompt_logprobs: int | None = None,
                    scores_prompt: bool = True, defaults: GenerationDefaults = GenerationDefaults()
                    ) -> SamplingParams:
    """Request fields -> engine params.  With ``n`` > 1 and a seed, choice i uses seed + i (modulo
    2**63, the engine's seed range) so the choices differ yet the whole answer is reproducible.
    ``reasoning`` (chat answers with a reasoning parser): a structured output constraint holds
    after the model's thinking (``ReasoningGate``), as the parser splits the answer.
    ``prompt_logprobs``: the engine's setting when the endpoint needs another than the request's
    field (a completion's echo with logprobs scores its prompt); ``scores_prompt`` False: none at
    all (a later choice of the same prompt: the first one's serve every choice). ``defaults``: the
    value of each sampling field the request leaves unset (the model's generation config)."""
    try:
        constraint = req.structured_outputs_params
        gate = None if reasoning is None else reasoning.gate
        if constraint is not None and gate is not None:
            constraint = dataclasses.replace(constraint, reasoning=gate)
        return SamplingParams(
            max_tokens=req.token_limit if req.token_limit is not None else defaults.default_max_tokens(
                default_max_tokens),
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            top_k=defaults.top_k if req.top_k is None else req.top_k,
            seed=None if req.seed is None else (req.seed + choice) % SEED_LIMIT,
            stop=tuple(req.stop_list),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=None if not scores_prompt else req.prompt_logprobs if prompt_logprobs is None
            else prompt_logprobs,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            min_p=defaults.min_p if req.min_p is None else req.min_p,
            min_tokens=req.min_tokens or 0,
            logit_bias=req.logit_bias or (),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=defaults.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
            allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
            bad_words=tuple(req.bad_words or ()),
            structured_outputs=constraint,
        )
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


# The dump and parse of a request's messages cost ~1.5 us a message and ~0.7 us a content part
# (measured on the 2-core host; ~5 us a message at 200 K of them): 256 take ~0.4 ms, about one
# hand-off to a thread, but a million-message body held the event loop (and /health) for seconds.
# Past this many they go to a thread, as request_body.parse_body does with big bodies.
_INLINE_PARTS = 256


def _parts_over(req: ChatRequestFields, limit: int) -> bool:
    """Whether the messages hold more than ``limit`` messages and parts (counting stops there, so
    the count itself costs at most ``limit`` steps on the loop)."""
    if len(req.messages) > limit:
        return True
    count = 0
    for m in req.messages:
        count += 1 + (len(m.content) if isinstance(m.content, list) else 0)
        if count > limit:
            return True
    return False


def _parsed_messages(req: ChatRequestFields) -> ParsedMessages:
    """The messages as the engine takes them (dicts), parsed once here: a malformed one is a 400
    now, and the engine's own ``parse_messages`` returns this parse (prompt/messages.py), which
    carries the request's chat-template options to the prompt layout."""
    return ParsedMessages([m.model_dump(exclude_none=True) for m in req.messages], req.template_options)


async def parsed_messages(req: ChatRequestFields) -> ParsedMessages:
    """``_parsed_messages``, on a thread for a long chat (``_INLINE_PARTS``); a 400 for a malformed one."""
    if _parts_over(req, _INLINE_PARTS):
        return await asyncio.to_thread(_parsed_messages, req)
    return _parsed_messages(req)
