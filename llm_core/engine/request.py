r"""A request carries its own progress: tokens, how many are computed, its page tables, sampling state.

Token timeline of one request (prompt P tokens, then generated ones):

    token_ids:   [p0 p1 ... p(P-1) | g0 g1 ... ]
                  \___ computed ___/^ num_computed_tokens
    a step computes token_ids[num_computed : num_computed + n]; when that reaches the last token the
    step also samples the next one (the request "samples" this step).

Page tables (one logical page index, see llm_core/kvcache/dual_pool.py):

    full_pages[p]  physical Full page of logical page p (all mapped)
    swa_pages[p]   physical SWA page of logical page p, -1 once released (always a leading run of -1)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from llm_core.engine.detokenizer import StopStringMatcher
from llm_core.engine.outputs import ErrorKind, RequestOutput
from llm_core.kvcache.page_keys import check_extra_keys
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.structured.grammar_state import GrammarState


@runtime_checkable
class EmbeddingSource(Protocol):
    """Embeddings for placeholder positions of a prompt, possibly arriving over time.

    - ``ready_until()``: prompt positions ``[0, ready_until())`` have their embeddings (or are plain
      text); the scheduler never computes a prompt token at or past it. Must never decrease.
    - ``rows(start, end)``: for prompt positions ``[start, end)`` (all < ready_until()) returns
      ``(mask, rows)``: ``mask`` bool [end-start], True where the position takes an embedding row
      instead of its token's embedding; ``rows`` either [mask.sum(), H] (only the masked positions,
      in order) or [end-start, H] (one per position; unmasked rows ignored). May be called again for
      the same range (after a preemption the request is recomputed).
    """

    def ready_until(self) -> int: ...

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # waiting, and its cached prefix is being read from L3 (not scheduled meanwhile)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and everything the scheduler/engine track about it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int  # admission order; the largest is the youngest (first to be preempted)
    eos_token_ids: tuple[int, ...] = ()
    embeds: EmbeddingSource | None = None
    # (start, end, content key) over prompt positions: media hashes the prefix cache mixes into the
    # keys of those tokens, so equal placeholder ids with different media never share KV.
    extra_keys: tuple[tuple[int, int, bytes], ...] = ()
    # prompt positions C where the prefix cache keeps a window of SWA KV, so a later prompt that
    # shares the first C tokens resumes there (the caller's boundaries: media region and message
    # ends; docs/kv_cache.md §7). Sorted, each in [1, prompt length]; the engine keeps at most
    # ``EngineConfig.prefix_checkpoints_per_request`` of them (``cap_checkpoints``).
    checkpoints: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)  # for wait-time aware queue orders
    # the ``priority`` queue policy's: lower is served first (0 under the other policies)
    priority: int = 0
    # incremental output text for ``params.stop`` (the engine makes one when it has a tokenizer)
    stop_matcher: StopStringMatcher | None = None
    # where the output stands in its params.structured_outputs grammar (the engine makes one)
    grammar: GrammarState | None = None
    # params.bad_words as token sequences (the engine tokenizes them: as written and after a space)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()

    token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: per prompt token so far (the first has none: None, rank 0, {})
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_logprob_ranks: list[int] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens a prefix cache supplied at the last admission
    # the most tokens this request has ever had: computed, or supplied by its first admission's
    # prefix hit. A preemption drops its KV but not this mark: what a recompute computes below it is
    # recomputed work, past it (and within the prompt) prompt tokens counted for the first time
    num_computed_high: int = 0
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)
    swa_released_pages: int = 0  # swa_pages[:swa_released_pages] are all -1
    tokens_since_swa_release: int = 0
    swa_peak_pages: int = 0  # high-water mark of live SWA pages (for tests and stats)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with ``error``
    stop_text: str | None = None  # output text cut before a matched stop string
    # ended by EOS or a stop token id: that token is not text (vLLM), unless include_stop_str_in_output
    stop_token_ended: bool = False
    generator: torch.Generator | None = None
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        check_extra_keys(self.extra_keys, len(self.prompt_token_ids))
        self.extra_keys = tuple((int(a), int(b), bytes(k)) for a, b, k in self.extra_keys)
        self.checkpoints = tuple(sorted({int(c) for c in self.checkpoints}))
        if self.checkpoints and not 1 <= self.checkpoints[0] <= self.checkpoints[-1] <= len(self.prompt_token_ids):
            raise ValueError(f"checkpoints must lie in [1, {len(self.prompt_token_ids)}] (the prompt), "
                             f"got {self.checkpoints[0]}..{self.checkpoints[-1]}")
        self.generator = self.params.make_generator()
        if self.params.prompt_logprobs is not None and self.prompt_token_ids:
            self.prompt_logprobs, self.prompt_logprob_ranks, self.prompt_top_logprobs = [None], [0], [{}]

    # ---- progress -----------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def schedulable_until(self) -> int:
        """Tokens ``[0, schedulable_until())`` may be computed now (embedding readiness frontier).

        Generated tokens are always ready; a prompt position waits for its embedding row.
        """
        if self.embeds is None:
            return self.num_tokens
        frontier = self.embeds.ready_until()
        if frontier >= self.num_prompt_tokens:
            return self.num_tokens
        return max(0, frontier)

    def prompt_ids_tensor(self) -> torch.Tensor:
        """The prompt's ids as a CPU int64 tensor, made once (the sampler's repetition penalty reads
        it every step)."""
        if self._prompt_tensor is None:
            self._prompt_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.long)
        return self._prompt_tensor

    @property
    def num_live_swa_pages(self) -> int:
        return len(self.swa_pages) - self.swa_released_pages

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt tokens whose logprob the request holds (the first token counts: it has none)."""
        return len(self.prompt_logprobs)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit may skip prompt positions: not while prompt logprobs are
        still to be computed (the cache keeps KV, not the logits those positions give)."""
        return self.params.prompt_logprobs is None or self.num_prompt_logprobs >= self.num_prompt_tokens

    # ---- results ------------------------------------------------------------------------------
    def add_prompt_logprobs(self, first: int, logprobs, ranks, top) -> None:
        """Prompt tokens ``first ..`` (a step's ``PromptLogprobs``); tokens already held -- the same
        rows computed again after a preemption -- are skipped, so each token is held once."""
        if first > self.num_prompt_logprobs:
            raise RuntimeError(f"{self.request_id}: prompt logprobs from token {first}, but only "
                               f"{self.num_prompt_logprobs} are held")
        skip = self.num_prompt_logprobs - first
        self.prompt_logprobs.extend(logprobs[skip:])
        self.prompt_logprob_ranks.extend(ranks[skip:])
        self.prompt_top_logprobs.extend(top[skip:])

    def append_token(self, token_id: int, logprob: float | None, top: dict[int, float] | None) -> None:
        """Append a sampled token (its grammar, if any, moves past it first: a token the grammar
        rejects raises before the request holds it)."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
            self.output_top_logprobs.append(top or {})

    def check_stop(self, max_model_len: int) -> str | None:
        """After a token was appended: the finish reason if the request must stop, else None.

        In this order: EOS (unless ignored) or a stop token id -> "stop"; a structured-output grammar
        that took its stop token -> "stop"; a stop string in the output text (once more than
        ``min_tokens`` tokens are out) -> "stop" (``stop_text`` = the text before it); max_tokens or
        the context limit -> "length".
        """
        last = self.output_token_ids[-1]
        p = self.params
        if (not p.ignore_eos and last in self.eos_token_ids) or last in p.stop_token_ids:
            self.stop_token_ended = True
            return "stop"  # before min_tokens the sampler masks these ids, so they cannot come
        if self.grammar is not None and self.grammar.terminated:
            return "stop"  # complete: it allows nothing more (ignore_eos or not)
        if p.stop:
            if self.stop_matcher is None:
                raise ValueError("stop strings need a tokenizer; this engine has none")
            # vLLM: stop strings are looked for once more than min_tokens tokens are out
            cut = self.stop_matcher.update(self.output_token_ids, search=self.num_output_tokens > p.min_tokens)
            if cut is not None:
                self.stop_text = cut
                return "stop"
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def output(self, new: list[int], num_cached_tokens: int) -> RequestOutput:
        """This request's state as a RequestOutput (cumulative), ``new``: the tokens this step added;
        ``num_cached_tokens``: what the prefix cache supplied at first admission (the scheduler knows)."""
        want_lp = self.params.logprobs is not None
        # once all are in (they never change after): the same lists, not a copy per step
        scored = self.params.prompt_logprobs is not None and self.num_prompt_logprobs >= self.num_prompt_tokens
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids),
            new_token_ids=new,
            logprobs=list(self.output_logprobs) if want_lp else None,
            top_logprobs=list(self.output_top_logprobs) if want_lp else None,
            prompt_logprobs=self.prompt_logprobs if scored else None,
            prompt_logprob_ranks=self.prompt_logprob_ranks if scored else None,
            prompt_top_logprobs=self.prompt_top_logprobs if scored else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            error_kind=self.error_kind,
            num_cached_tokens=num_cached_tokens,
        )

    def final_text(self, tokenizer) -> str | None:
        """The finished request's text (RequestOutput.text): None without a tokenizer, else its
        output cut before the stop string it matched, or all of its output but the EOS or stop token
        id that ended it (kept with ``include_stop_str_in_output``; "" when there is none).
        The decode may raise: the engine ends only this request then."""
        if tokenizer is None:
            return None
        if self.stop_text is not None:
            return self.stop_text
        ids = self.output_token_ids
        if self.stop_token_ended and not self.params.include_stop_str_in_output:
            ids = ids[:-1]  # as vLLM: the EOS or stop token id that ended it stays in token_ids only
        return tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens) if ids else ""

    def reset_for_recompute(self) -> None:
        """Preempted: all KV is dropped; every token (prompt and generated) is computed again
        (``num_computed_high`` stays: what was computed once)."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.full_pages = []
        self.swa_pages = []
        self.swa_released_pages = 0
        self.tokens_since_swa_release = 0
        self.num_preemptions += 1
        self.status = RequestStatus.WAITING


def cap_checkpoints(checkpoints: Sequence[int], limit: int) -> tuple[int, ...]:
    """At most ``limit`` of a request's checkpoint positions (sorted, duplicates dropped): the first
    (the end of the system prompt or first message, where other chats branch) and the last
    ``limit - 1`` (the latest media and message ends, where the next turn or another question about
    the same media branches). Each kept checkpoint can keep a window of SWA KV per sliding layer in
    the prefix cache, so a prompt with 1000 media items must not ask for 1000 windows:

        limit 4, checkpoints 10 20 30 40 50 60  ->  10 40 50 60
    """
    if limit < 0:
        raise ValueError(f"the checkpoint limit must be >= 0, got {limit}")
    ordered = sorted({int(c) for c in checkpoints})
    if len(ordered) <= limit:
        return tuple(ordered)
    if limit == 0:
        return ()
    return (ordered[0], *ordered[len(ordered) - limit + 1:])


def truncate_prompt(ids: list[int], keep: int, has_embeds: bool, extra_keys: tuple,
                    checkpoints: tuple) -> tuple[list[int], tuple, tuple]:
    """``SamplingParams.truncate_prompt_tokens``: the prompt's last ``keep`` tokens, with its extra
    keys and checkpoints moved along (those before the cut dropped); unchanged when it is no
    longer. A prompt with embedding rows (media) is never cut: ValueError instead."""
    if len(ids) <= keep:
        return ids, extra_keys, checkpoints
    if has_embeds:
        raise ValueError(f"would cut a prompt of {len(ids)} tokens that holds media; shorten the conversation instead")
    cut = len(ids) - keep
    keys = tuple((a - cut, b - cut, key) for a, b, key in extra_keys if a >= cut)
    return ids[cut:], keys, tuple(c - cut for c in checkpoints if c > cut)
