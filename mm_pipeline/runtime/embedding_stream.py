r"""An :class:`llm_core.EmbeddingSource` whose placeholder rows arrive while the request runs.

A request's token layout is fixed before any of its media is encoded: every encoder unit (an image,
one video frame group, one audio segment) owns a contiguous run of placeholder positions, a *span*.
Units are filled as the encoder batcher (or a cache hit) delivers them, in any order; the readiness
frontier is the start of the first span still empty:

    prompt     [ text | span0 | text | span1 | span2 | text | span3 | text ]
    filled              yes            yes     no             yes
    ready_until()  = span2.start           (span3 waits for span2: prefill is strictly in order)

After span2 arrives the frontier jumps past span3 to the end of the prompt. It never moves back.
The scheduler computes prompt tokens only below the frontier, so prefill of the early chunks overlaps
decoding and encoding of later frame groups.

Thread use: ``fill`` is called from the engine thread (encoder outputs) or the event loop (cache
hits); ``ready_until`` / ``rows`` from the engine thread. A lock guards the shared state.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class PlaceholderSpan:
    """Prompt positions ``[start, end)`` that take the rows of one encoder unit (cache key ``key``)."""

    start: int
    end: int
    key: str

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"placeholder span needs 0 <= start < end, got [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        return self.end - self.start


class EmbeddingStream:
    """Placeholder rows of one prompt, filled unit by unit (see module doc).

    Invariants (under ``_lock``): spans are sorted and disjoint inside ``[0, prompt_len)``;
    ``_frontier_span`` is the index of the first unfilled span (``len(spans)`` when all are filled);
    ``ready_until()`` never decreases.
    """

    def __init__(self, prompt_len: int, spans: Sequence[PlaceholderSpan], hidden_size: int,
                 on_progress: Callable[[], None] | None = None, device: torch.device | None = None,
                 min_advance: int = 0, encoder_busy: Callable[[], bool] | None = None) -> None:
        """``device``: the LLM's (rank 0's) device; rows encoded elsewhere (an encoder on its own GPU)
        start their copy there as they arrive, without blocking, long before prefill reads them.
        ``min_advance``: ``ready_until`` moves only by at least this many positions, or to the end
        of the prompt -- the scheduler then prefills in fewer, larger steps (each step has a fixed
        cost, and on a CPU host it competes with the decoding the first token waits for). Once
        fewer placeholder rows than that are still missing, the bar drops to what is missing: the
        rows held back would otherwise all land in the last step, after the last unit arrives,
        where they add to the time to first token instead of overlapping the encoder (see
        ``ready_until``) -- unless ``encoder_busy()`` says encoder work is queued: then the
        encoder, not the prefill, is what the first token waits for, and an early step would only
        take CPU from it."""
        spans = list(spans)
        for a, b in zip(spans, spans[1:]):
            if b.start < a.end:
                raise ValueError(f"placeholder spans overlap or are unsorted: [{a.start}, {a.end}) then "
                                 f"[{b.start}, {b.end})")
        if spans and spans[-1].end > prompt_len:
            raise ValueError(f"placeholder span [{spans[-1].start}, {spans[-1].end}) ends past the prompt "
                             f"of {prompt_len} tokens")
        self.prompt_len = prompt_len
        self.spans: tuple[PlaceholderSpan, ...] = tuple(spans)
        self.hidden_size = hidden_size
        self._starts = [s.start for s in spans]
        self._rows: list[torch.Tensor | None] = [None] * len(spans)
        self._frontier_span = 0
        self._error: BaseException | None = None
        self._released = False
        self._lock = threading.Lock()
        self._on_progress = on_progress
        self._device = device
        self._min_advance = min_advance
        self._reported = 0  # what ready_until last said (monotonic)
        self._missing_rows = sum(s.length for s in spans)  # rows of the spans not filled yet
        self._encoder_busy = encoder_busy

    # ---- EmbeddingSource --------------------------------------------------------------------
    def ready_until(self) -> int:
        """The readiness frontier, reported in moves of at least ``min(min_advance, rows still
        missing)`` (or to the end of the prompt). The second bound is for the end of a video:

            min_advance 256, frame groups of 25 rows
            early: 1000 rows missing, 230 ready past the last report -> hold (a step per 256 rows)
            late:    25 rows missing,  25 ready past the last report -> report: the step that runs
                     after the last group arrives (the one the first token waits for) then carries
                     that group and the text after it, not up to 255 rows held back as well

        With encoder work queued the bar stays ``min_advance`` (see ``__init__``). The bar only
        decides when to step early: the last unit's arrival always reports the end of the prompt
        (and wakes the engine), so no request waits on the encoder's state.
        """
        busy = self._encoder_busy is not None and self._encoder_busy()  # outside _lock: the batcher
        with self._lock:                                                  # fills under its own locks
            frontier = self._frontier_start()
            bar = self._min_advance if busy else min(self._min_advance, self._missing_rows)
            if frontier == self.prompt_len or frontier - self._reported >= bar:
                self._reported = frontier
            return self._reported

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mask of placeholder positions in ``[start, end)`` and their rows, in position order."""
        if not 0 <= start <= end <= self.prompt_len:
            raise ValueError(f"rows({start}, {end}) outside the prompt [0, {self.prompt_len})")
        mask = torch.zeros(end - start, dtype=torch.bool)
        parts: list[torch.Tensor] = []
        with self._lock:
            # first span that may overlap: the last one starting at or before `start`
            i = max(0, bisect.bisect_right(self._starts, start) - 1)
            while i < len(self.spans) and self.spans[i].start < end:
                span = self.spans[i]
                lo, hi = max(start, span.start), min(end, span.end)
                if lo < hi:
                    rows = self._rows[i]
                    if rows is None:
                        raise RuntimeError(f"rows [{lo}, {hi}) requested before their unit {span.key[:16]} "
                                           f"arrived (frontier {self._frontier_start()})")
                    mask[lo - start:hi - start] = True
                    parts.append(rows[lo - span.start:hi - span.start])
                i += 1
        if not parts:
            return mask, torch.zeros(0, self.hidden_size)
        return mask, torch.cat([p.to(parts[0].device) for p in parts])

    # ---- producer side ----------------------------------------------------------------------
    def fill(self, index: int, rows: torch.Tensor) -> None:
        """Deliver the rows of span ``index`` ([span.length, hidden]); filling twice is an error.
        Rows arriving after ``release`` (the request ended while its unit was in flight) are dropped."""
        if not 0 <= index < len(self.spans):
            raise IndexError(f"span {index} outside [0, {len(self.spans)})")
        span = self.spans[index]
        if rows.dim() != 2 or rows.shape[0] != span.length or rows.shape[1] != self.hidden_size:
            raise ValueError(f"unit {index} needs rows [{span.length}, {self.hidden_size}], "
                             f"got {tuple(rows.shape)}")
        if self._device is not None and rows.device != self._device:
            # to the LLM's GPU without blocking: ordered before the prefill on that device's stream;
            # to a CPU LLM a blocking copy (an asynchronous one would be read before it landed)
            rows = rows.to(self._device, non_blocking=self._device.type == "cuda")
        with self._lock:
            if self._released:
                return
            if self._rows[index] is not None:
                raise ValueError(f"span {index} was already filled")
            self._rows[index] = rows
            self._missing_rows -= span.length
            moved = False
            while self._frontier_span < len(self.spans) and self._rows[self._frontier_span] is not None:
                self._frontier_span += 1
                moved = True
        if moved and self._on_progress is not None:
            self._on_progress()

    def fail(self, error: BaseException) -> None:
        """Record why the stream can never complete (the owner aborts the request)."""
        with self._lock:
            if self._error is None:
                self._error = error
        if self._on_progress is not None:
            self._on_progress()

    # ---- queries ----------------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    @property
    def complete(self) -> bool:
        with self._lock:
            return self._frontier_span == len(self.spans)

    def missing(self) -> list[int]:
        """Indices of spans not filled yet."""
        with self._lock:
            return [i for i, r in enumerate(self._rows) if r is None]

    def extra_keys(self) -> tuple[tuple[int, int, bytes], ...]:
        """(start, end, content key) per span, for prefix-cache keys over placeholder ranges."""
        return tuple((s.start, s.end, s.key.encode()) for s in self.spans)

    def release(self) -> None:
        """Drop the stored rows (the request is over; a later ``rows`` call is an error)."""
        with self._lock:
            self._rows = [None] * len(self.spans)
            self._released = True

    def check_integrity(self) -> None:
        with self._lock:
            if self._released:
                return
            f = self._frontier_span
            if not all(r is not None for r in self._rows[:f]):
                raise AssertionError("a span below the frontier is empty")
            if f < len(self.spans) and self._rows[f] is not None:
                raise AssertionError("the frontier span is filled but the frontier did not advance")

    # ---- internal helpers -------------------------------------------------------------------
    def _frontier_start(self) -> int:
        return self.prompt_len if self._frontier_span == len(self.spans) else self.spans[self._frontier_span].start
