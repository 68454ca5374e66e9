"""Admission: the Request built from what ``LLMEngine.add_request`` was given, and whether the
engine can serve it, decided when it is added (any thread), so that a request it cannot serve ends at once with finish_reason "error" and a message
naming the problem (LLMEngine.add_request), never inside a step: the prompt against the context
limit and the vocabulary, the sampling parameters against the model and the engine's features, the
priority against the queue policy, bad words tokenized and structured-output grammars compiled."""

from __future__ import annotations

import operator

from llm_core.engine.detokenizer import StopStringMatcher
from llm_core.engine.outputs import ErrorKind, RequestError
from llm_core.engine.queue_policy import QueuePolicy
from llm_core.engine.request import EmbeddingSource, Request, cap_checkpoints, truncate_prompt
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.sampling.prompt_logprobs import check_prompt_logprobs
from llm_core.engine.structured.compiler import GrammarCompiler, GrammarError
from llm_core.engine.structured.grammar_state import GrammarState
from llm_core.engine.structured.params import StructuredOutputsParams
from llm_core.kvcache.page_keys import check_cache_salt, salted_extra_keys


class Admission:
    """The checks of one engine: its model's vocabulary, its context limits, its tokenizer and
    grammar compiler (either may be None) and its queue policy."""

    def __init__(self, *, vocab_size: int, max_context_tokens: int, max_model_len: int, tokenizer,
                 grammars: GrammarCompiler | None, queue_policy: QueuePolicy,
                 eos_token_ids: tuple[int, ...] = (), checkpoints_per_request: int = 32) -> None:
        self.vocab_size = vocab_size
        self.max_context_tokens, self.max_model_len = max_context_tokens, max_model_len
        self.tokenizer, self.grammars, self.queue_policy = tokenizer, grammars, queue_policy
        self.eos_token_ids, self.checkpoints_per_request = eos_token_ids, checkpoints_per_request

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int, *,
              embeds: EmbeddingSource | None = None, extra_keys: tuple[tuple[int, int, bytes], ...] = (),
              checkpoints: tuple[int, ...] = (), priority: int = 0,
              cache_salt: str | None = None) -> tuple[Request, RequestError | None]:
        """The Request ``LLMEngine.add_request`` queues (its arguments: see there), and why it cannot
        be served (None if it can). Its prompt cut to ``truncate_prompt_tokens`` and its cache salt
        mixed into its prefix-cache keys first; bad words tokenized and its grammar state built
        (compiled, or found compiled) when nothing else is wrong. Raises only for what is the
        caller's bug rather than the request's (params of the wrong type, stop strings without a
        tokenizer)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        matcher = StopStringMatcher(self.tokenizer, params.stop, params.skip_special_tokens,
                                    params.include_stop_str_in_output) if params.stop else None
        truncation_problem = None
        if params.truncate_prompt_tokens is not None:
            k = params.truncate_prompt_tokens  # -1: what the context holds with room for one token
            try:
                prompt_token_ids, extra_keys, checkpoints = truncate_prompt(
                    list(prompt_token_ids), max(1, self.max_context_tokens - 1) if k == -1 else k,
                    embeds is not None, tuple(extra_keys), tuple(checkpoints))
            except ValueError as exc:
                truncation_problem = RequestError(ErrorKind.INVALID_INPUT, f"truncate_prompt_tokens={k}: {exc}")
        salt_problem = check_cache_salt(cache_salt)
        if cache_salt is not None and salt_problem is None and (embeds is None or extra_keys):
            # after the cut, so the salt sits on the first token kept (with media but no content
            # keys the cache is bypassed anyway: SWARadixCache._may_match)
            extra_keys = salted_extra_keys(tuple(extra_keys), cache_salt, len(prompt_token_ids))
        req = Request(request_id, list(prompt_token_ids), params, arrival, eos_token_ids=self.eos_token_ids,
                      embeds=embeds, extra_keys=tuple(extra_keys),
                      checkpoints=cap_checkpoints(checkpoints, self.checkpoints_per_request),
                      stop_matcher=matcher, priority=priority if type(priority) is int else 0)
        problem = (truncation_problem or self.check_priority(priority)
                   or (RequestError(ErrorKind.INVALID_INPUT, salt_problem) if salt_problem else None)
                   or self.check_prompt(req.prompt_token_ids, has_embeds=embeds is not None)
                   or self.check_params(params) or check_prompt_logprobs(len(req.prompt_token_ids), params))
        if problem is None and params.bad_words:
            req.bad_word_ids = self.bad_word_ids(params.bad_words)
        if problem is None and params.structured_outputs is not None:
            try:
                req.grammar = GrammarState(self.grammars.compile(params.structured_outputs), params.structured_outputs,
                                           req.prompt_token_ids)
            except GrammarError as exc:
                problem = RequestError(ErrorKind.INVALID_INPUT, str(exc))
        return req, problem

    def check_prompt(self, prompt_token_ids: list[int], has_embeds: bool = False) -> RequestError | None:
        """Why this prompt cannot be served (None if it can): too long for ``max_context_tokens``
        (``CONTEXT_LENGTH``) or malformed (``INVALID_INPUT``). Placeholder ids may be out of the
        vocabulary when an embedding source covers them."""
        if len(prompt_token_ids) == 0:
            return RequestError(ErrorKind.INVALID_INPUT, "empty prompt: at least one token is needed")
        if len(prompt_token_ids) + 1 > self.max_context_tokens:
            why = "" if self.max_context_tokens == self.max_model_len else (
                f" (what the KV pool holds for one request; max_model_len is {self.max_model_len})")
            return RequestError(ErrorKind.CONTEXT_LENGTH,
                                f"prompt of {len(prompt_token_ids)} tokens leaves no room to generate within "
                                f"the context limit of {self.max_context_tokens} tokens{why}")
        if not has_embeds:
            vocab = self.vocab_size
            bad = [t for t in prompt_token_ids if not _is_token(t) or not 0 <= t < vocab]
            if bad:
                return RequestError(ErrorKind.INVALID_INPUT,
                                    f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        return None

    def check_params(self, params: SamplingParams) -> RequestError | None:
        """Why these sampling params cannot be served by this model (None if they can): a logit_bias
        token id outside the vocabulary, structured outputs on an engine without them
        (``INVALID_INPUT``)."""
        if params.bad_words and self.tokenizer is None:
            return RequestError(ErrorKind.INVALID_INPUT, "bad_words need a tokenizer; this engine has none")
        if params.allowed_token_ids is not None and params.allowed_token_ids[-1] >= self.vocab_size:
            return RequestError(ErrorKind.INVALID_INPUT,
                                f"allowed_token_ids holds {params.allowed_token_ids[-1]}, outside the vocabulary "
                                f"[0, {self.vocab_size})")
        if params.structured_outputs is not None and self.grammars is None:
            why = "no tokenizer" if self.tokenizer is None else "structured_outputs_backend none"
            return RequestError(ErrorKind.INVALID_INPUT, f"structured outputs are off on this engine ({why})")
        vocab = self.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            return RequestError(ErrorKind.INVALID_INPUT,
                                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return None

    def check_priority(self, priority: int) -> RequestError | None:
        """Why a request cannot have this ``priority`` under this engine's queue policy (None if it
        can; ``QueuePolicy.check_priority``)."""
        problem = self.queue_policy.check_priority(priority)
        return None if problem is None else RequestError(ErrorKind.INVALID_INPUT, problem)

    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` as the token sequences that would write them: each word as written and after
        a space (how it appears mid-text for most tokenizers), as vLLM tokenizes them."""
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(int(t) for t in self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    seqs[ids] = None
        return tuple(seqs)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` now (any thread; cached, so ``add_request`` then finds it): a
        ``GrammarError`` (a ValueError) when it cannot be served. Servers call it off their event
        loop before admitting a request, so a miss never runs inside ``add_request``."""
        if self.grammars is None:
            raise GrammarError(self.check_params(SamplingParams(structured_outputs=params)).message)
        self.grammars.compile(params)


def _is_token(t) -> bool:
    try:
        operator.index(t)
    except TypeError:
        return False
    return not isinstance(t, bool)
