"""One request as the server's metrics and request log see it: its choices' tokens as they come,
and its end exactly once, whatever the end (the ``Observer`` is the app's: server/request_observer.py).

    ChatService:  watch = RequestWatch(rid, arrival, per_prompt, observer)
                  ChoiceStream(..., on_tokens=watch.tokens)   a choice's first tokens: its TTFT;
                                                                every later token: a gap
                  start_all    cancelled (the client left while the request waited for its first
                               token: queued, its media in work) ─────────────────────► watch.end
                  collect_all  finally: done, failed, or cancelled (client gone) ──────► watch.end
                  chunks() / events()  finally ────────────────────────────────────────► watch.end
                  the stream's close() (the response ended, however) ──────────────────► watch.end

A streamed answer has two ends because a client that leaves while a chunk is being sent leaves the
generator suspended at its ``yield`` (its ``finally`` runs only when it is closed or collected);
the response's ``close`` comes first then. Whichever comes first observes; the other does nothing.
A request the engine refuses at its start (400, 429: ``start_all`` raises) is no generation: its
status is counted by ``mmserve_requests_total`` only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, Sequence

from mm_pipeline.server.completions.choices import ChoiceState, ChoiceStream, collect_all, start_all

ABORTED = "abort"  # what a choice that did not finish ended as (vLLM's finished_reason label)


class Observer(Protocol):
    def tokens(self, arrival: float, previous: float | None, now: float, count: int) -> None:
        """``count`` tokens of one choice came at ``now`` (time.perf_counter); ``previous``: when that
        choice's tokens before them came, None when these are its first."""

    def finished(self, rid: str, arrival: float, end: float, states: Sequence[ChoiceState], per_prompt: int) -> None:
        """The request ended at ``end``: its choices' states, in groups of ``per_prompt`` that share a
        prompt (token_usage.py); a choice whose ``finish_reason`` is None ended as ``ABORTED``."""


class RequestWatch:
    """One request's way to the observer: ``tokens`` per batch of a choice's tokens, ``end`` once."""

    def __init__(self, rid: str, arrival: float, per_prompt: int, observer: Observer | None) -> None:
        self.rid, self.arrival, self.per_prompt = rid, arrival, per_prompt
        self._observer = observer
        self._ended = observer is None

    def tokens(self, previous: float | None, now: float, count: int) -> None:
        if not self._ended:
            self._observer.tokens(self.arrival, previous, now, count)

    def end(self, choices: Sequence[ChoiceStream]) -> None:
        """Observe the request's end (the first call; later ones do nothing): ``choices`` as they are now."""
        if self._ended:
            return
        self._ended = True
        self._observer.finished(self.rid, self.arrival, time.perf_counter(), [c.state for c in choices],
                                self.per_prompt)

    async def start(self, choices: list[ChoiceStream]) -> None:
        """``start_all``; a client that leaves meanwhile (the request cancelled while it waits for its
        first delta) ends the request in the metrics too. One the engine refuses (it raises) is no
        generation (module doc)."""
        try:
            await start_all(choices)
        except asyncio.CancelledError:
            self.end(choices)
            raise

    async def collect(self, choices: list[ChoiceStream]) -> list[ChoiceState]:
        """``collect_all``, the request observed however it ends: done, a choice failed, or cancelled
        there because the client left (the app answers 499 then)."""
        try:
            return await collect_all(choices)
        finally:
            self.end(choices)
