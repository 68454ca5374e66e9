"""MediaFeed: the media units of one chat request flowing into its EmbeddingStream.

    MediaPlanner ──rows of unit k──► sink k ──fill──► EmbeddingStream ──on_progress──► engine thread
                 ──error───────────►        ──fail──► stream.error, and the request is aborted

Opened by ``OmniRuntime.open_media`` once the chat is laid out; ``deliver_cached`` before the
request is submitted; ``start`` when the request may take rows (right after it was submitted when
embeddings stream -- a unit failing later aborts it --, before it is submitted otherwise);
``close`` when the request is over: the batcher forgets the sinks (their unit claims go) and the
stream drops its rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

from mm_pipeline.encode.batcher import UnitSink
from mm_pipeline.encode.planner import MediaPlan, MediaPlanner
from mm_pipeline.errors import MediaError, Where
from mm_pipeline.runtime.embedding_stream import EmbeddingStream


class MediaFeed:
    def __init__(self, stream: EmbeddingStream, plans: list[MediaPlan],
                 spans_of_plan: list[list[list[tuple[int, int]]]], planner: MediaPlanner,
                 abort_request: Callable[[], None], parts: Sequence[Where] = ()) -> None:
        """``spans_of_plan[p][u]``: the (stream span index, first row) pieces unit ``u`` of
        ``plans[p]`` fills -- one piece for most units, several for a video's sound segment whose
        rows are laid out in time slices; ``abort_request`` ends the request when a unit fails;
        ``parts[p]``: the content part ``plans[p]``'s media came from, which its errors name."""
        self.stream = stream
        self._plans = plans
        self._planner = planner
        self._abort_request = abort_request
        parts = list(parts) + [Where()] * (len(plans) - len(parts))
        self._sinks = [[self._unit_sink(pieces, part) for pieces in units] for units, part in zip(spans_of_plan, parts)]

    def deliver_cached(self) -> None:
        """Fill the spans of units found in the cache at planning, now: before the request is
        submitted, so its first step already sees them (a repeat prefills in one step, not in one
        step per wake-up race). A failure here (rows of the wrong size) is ``stream.error``."""
        for plan, sinks in zip(self._plans, self._sinks):
            self._planner.deliver_cached(plan, sinks)

    def start(self) -> None:
        """Deliver cached units and produce the rest (see ``MediaPlanner.start``)."""
        for plan, sinks in zip(self._plans, self._sinks):
            self._planner.start(plan, sinks)

    def close(self) -> None:
        for plan, sinks in zip(self._plans, self._sinks):
            self._planner.detach(plan, sinks)
        self.stream.release()

    def _unit_sink(self, pieces: list[tuple[int, int]], part: Where) -> UnitSink:
        """Deliver one unit's rows into its span(s); an error (or rows that do not fit) fails the
        request, named by ``part`` (a new error: the unit's is shared by every request waiting on it)."""
        def sink(rows, error) -> None:
            if error is None:
                try:
                    if len(pieces) == 1 and pieces[0][1] == 0:
                        self.stream.fill(pieces[0][0], rows)
                    else:
                        laid = sum(self.stream.spans[span].length for span, _ in pieces)
                        if rows.shape[0] != laid:
                            raise ValueError(f"a unit laid out over {laid} positions got {rows.shape[0]} rows")
                        for span, row in pieces:
                            self.stream.fill(span, rows[row:row + self.stream.spans[span].length])
                    return
                except Exception as exc:  # wrong-sized rows: fail this request, not the deliverer
                    error = exc
            if part and isinstance(error, MediaError) and not error.loc:
                located = error.located(f"{part}: {error}", part)
                located.__cause__ = error  # public_message cleans the unit's sentence by it
                error = located
            self.stream.fail(error)
            self._abort_request()  # its queue then gets the abort output; outputs() raises the error
        return sink
