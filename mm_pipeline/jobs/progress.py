"""Progress reporting for long CLI jobs: a redrawn bar on a terminal, plain lines otherwise.

    TTY:      caption [██████████░░░░░░░░░░]  12/40  30%  3.1 items/s  ETA 0:09  2 failed
    not TTY:  caption: 12/40 (30%) 3.1 items/s ETA 9s, 2 failed        (every interval_s)

Rates are over the whole run (items done / elapsed), which is what ETA needs for a batch job
whose per-item cost does not drift.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts finished items (``advance``) and reports; ``close`` prints the final state."""

    def __init__(self, total: int, label: str = "progress", stream: TextIO | None = None,
                 is_tty: bool | None = None, interval_s: float | None = None, width: int = 24) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty() if is_tty is None else is_tty
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.is_tty else 5.0)
        self.width = width
        self.done = 0
        self.failed = 0
        self.start = time.perf_counter()
        self._last_report = float("-inf")
        self._closed = False

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    @property
    def rate(self) -> float:
        e = self.elapsed_s
        return self.done / e if e > 0 else 0.0

    @property
    def eta_s(self) -> float:
        r = self.rate
        return (self.total - self.done) / r if r > 0 else float("inf")

    def advance(self, n: int = 1, failed: int = 0) -> None:
        self.done += n
        self.failed += failed
        now = time.perf_counter()
        if now - self._last_report >= self.interval_s or self.done >= self.total:
            self._last_report = now
            self._report(final=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._report(final=True)

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        failed = f", {self.failed} failed" if self.failed else ""
        if self.is_tty:
            filled = int(self.width * self.done / self.total) if self.total else self.width
            bar = "█" * filled + "░" * (self.width - filled)
            return (f"{self.label} [{bar}] {self.done:>{len(str(self.total))}}/{self.total} {pct:3.0f}%  "
                    f"{self.rate:.2f} items/s  ETA {format_duration(self.eta_s)}{failed.replace(',', ' ')}")
        return (f"{self.label}: {self.done}/{self.total} ({pct:.0f}%) {self.rate:.2f} items/s "
                f"ETA {format_duration(self.eta_s)}{failed}")

    def _report(self, final: bool) -> None:
        if self.is_tty:
            self.stream.write("\r\x1b[2K" + self.line() + ("\n" if final else ""))
        elif not final or self.done < self.total or self._last_report == float("-inf"):
            self.stream.write(self.line() + "\n")
        self.stream.flush()
