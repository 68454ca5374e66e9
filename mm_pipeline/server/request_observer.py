"""What the app records of each request (the ``Observer`` of completions/request_watch.py): the
per-generation metrics -- each choice is a generation, as each of vLLM's n sub-requests is --
and, with ``--enable-log-requests``, one line per request on the ``mmserve.requests`` logger.

    tokens(...)    as a choice's tokens come: its time to first token, then every gap between tokens
    finished(...)  once per request, however it ended: per choice its finished_reason ("abort" when
                   it did not finish), prompt and generated tokens, its own end (e2e) and mean time
                   per output token; then the log line
"""

from __future__ import annotations

import logging
from typing import Sequence

from mm_pipeline.server.completions.choices import ChoiceState
from mm_pipeline.server.completions.request_watch import ABORTED
from mm_pipeline.server.completions.token_usage import prompts_usage
from mm_pipeline.server.metrics import ServerMetrics

request_log = logging.getLogger("mmserve.requests")  # --enable-log-requests: a line per request


def request_line(rid: str, arrival: float, end: float, states: Sequence[ChoiceState], per_prompt: int) -> str:
    """One ended request for the log: its id, how its choices ended, its tokens as its answer's usage
    counts them (each prompt once: token_usage.prompts_usage), ``n`` (choices per prompt) and the
    number of prompts, first token and total time (no prompt text: what users send stays out of the log)."""
    first = [s.first_token_at for s in states if s.first_token_at is not None]
    ends = ",".join(sorted({(s.finish_reason or ABORTED) + (f" ({s.error_kind})" if s.error_kind else "")
                            for s in states}))
    usage = prompts_usage(list(states), per_prompt)
    hits = states[0].encoder_cache_hits if states else 0
    return (f"{rid}: {ends or 'no choice'}, prompt {usage.prompt_tokens} tokens "
            f"(cached {usage.prompt_tokens_details.cached_tokens}), completion {usage.completion_tokens} tokens, "
            f"n {per_prompt}, prompts {len(states) // per_prompt}, "
            f"TTFT {f'{min(first) - arrival:.3f} s' if first else '-'}, total {end - arrival:.3f} s, "
            f"encoder cache hits {hits}")


class RequestObserver:
    """The app's observer: ``metrics`` always, the request log when ``log_requests``."""

    def __init__(self, metrics: ServerMetrics, log_requests: bool = False) -> None:
        self.metrics = metrics
        self.log_requests = log_requests

    def tokens(self, arrival: float, previous: float | None, now: float, count: int) -> None:
        self.metrics.observe_tokens(arrival, previous, now, count)

    def finished(self, rid: str, arrival: float, end: float, states: Sequence[ChoiceState], per_prompt: int) -> None:
        for s in states:
            self.metrics.observe_request(arrival, end if s.finished_at is None else s.finished_at,
                                         s.finish_reason or ABORTED, s.prompt_tokens, s.completion_tokens,
                                         s.first_token_at, s.last_token_at)
        if self.log_requests:
            request_log.info("%s", request_line(rid, arrival, end, states, per_prompt))
