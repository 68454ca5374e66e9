"""StageTimeline: when each pipeline stage ran, so overlap is seen rather than inferred.

    decode   ███░░███░░░███                 video chunks on the media workers
    encode      ██  ██   ██                 encoder forwards (worker thread or engine thread)
    prefill    █ ██ ██ █ ██ ██              LLM steps

Spans are (stage, start, end) in ``time.monotonic()`` seconds, appended from any thread by the
hooks ``OmniRuntime.record_timeline`` wires; off (no hooks, no cost) unless asked for. Bounded: the
oldest spans go first. ``summary`` gives each stage's busy time (the union of its spans) and the
time two stages were busy together, over a window such as one request's lifetime.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable

STAGES = ("decode", "encode", "prefill")


@dataclass(frozen=True)
class Span:
    stage: str
    start: float
    end: float


class StageTimeline:
    def __init__(self, max_spans: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._spans: deque[Span] = deque(maxlen=max_spans)

    def add(self, stage: str, start: float, end: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r} (one of {STAGES})")
        with self._lock:
            self._spans.append(Span(stage, start, max(start, end)))

    def spans(self, start: float = float("-inf"), end: float = float("inf")) -> list[Span]:
        """Spans that intersect [start, end], clipped to it."""
        with self._lock:
            found = list(self._spans)
        return [Span(s.stage, max(s.start, start), min(s.end, end)) for s in found
                if s.end > start and s.start < end]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def summary(self, start: float, end: float) -> dict[str, float]:
        """Per stage over [start, end] (seconds from ``start``): ``<stage>_first``, ``<stage>_last``
        (end of its last span), ``<stage>_busy`` (union of its spans), ``<stage>_spans`` (how many:
        LLM steps, encoder forwards, decoded chunks); per pair ``<a>_<b>_overlap`` (both busy at
        once)."""
        spans = self.spans(start, end)
        unions = {st: _union((s.start, s.end) for s in spans if s.stage == st) for st in STAGES}
        out: dict[str, float] = {}
        for st, runs in unions.items():
            out[f"{st}_busy"] = sum(b - a for a, b in runs)
            out[f"{st}_first"] = runs[0][0] - start if runs else 0.0
            out[f"{st}_last"] = runs[-1][1] - start if runs else 0.0
            out[f"{st}_spans"] = float(sum(1 for s in spans if s.stage == st))
        for i, a in enumerate(STAGES):
            for b in STAGES[i + 1:]:
                out[f"{a}_{b}_overlap"] = _intersection(unions[a], unions[b])
        return out


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    runs: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if runs and a <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return runs


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total
