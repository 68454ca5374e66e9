"""Progress of long CLI jobs through tqdm: a bar on a terminal, plain lines otherwise.

    TTY:      caption:  30%|███       | 12/40 [00:03<00:09,  3.10item/s, 2 failed]
    not TTY:  caption: 12/40 (30%) 3.10 items/s ETA 00:09, 2 failed        (every interval_s)

A log file gets whole lines, not a bar redrawn with carriage returns; both come from tqdm's
formatter. Rates are over the whole run (items done / elapsed, tqdm's ``smoothing=0``), which is
what ETA needs for a batch job whose per-item cost does not drift.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

PLAIN_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) {rate_noinv_fmt} ETA {remaining}{postfix}"
# Failures a job summary names (the rest are counted): the output file has every one, and a summary
# that kept them all would hold a message per failed input for the whole run.
FAILURES_SHOWN = 20


class Progress:
    """Counts finished items (``advance``) and reports; ``close`` prints the final state (nothing
    when there was nothing to do)."""

    def __init__(self, total: int, label: str = "progress", stream: TextIO | None = None,
                 is_tty: bool | None = None, interval_s: float | None = None) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty() if is_tty is None else is_tty
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.is_tty else 5.0)
        self.done = 0
        self.failed = 0
        self.start = time.perf_counter()
        self._last_line = float("-inf")
        self._closed = False
        self._bar = tqdm(total=total, desc=label, unit="item", file=self.stream, mininterval=self.interval_s,
                         smoothing=0, dynamic_ncols=True) if self.is_tty and total else None

    def advance(self, n: int = 1, failed: int = 0) -> None:
        self.done += n
        self.failed += failed
        if self._bar is not None:
            if failed:
                self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(n)  # redraws at most every interval_s
            return
        now = time.perf_counter()
        if now - self._last_line >= self.interval_s or self.done >= self.total:
            self._last_line = now
            self._write_line()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()  # the final state, then a newline
        elif self.total and (self.done < self.total or self._last_line == float("-inf")):
            self._write_line()  # unless the last advance already printed the final state

    def line(self) -> str:
        """The plain (not TTY) report of the current state."""
        line = tqdm.format_meter(self.done, self.total, time.perf_counter() - self.start, prefix=self.label,
                                 unit=" items", bar_format=PLAIN_FORMAT, postfix=self._postfix())
        return " ".join(line.split())  # tqdm pads rates to a fixed width, for bars redrawn in place

    def _postfix(self) -> str:
        return f"{self.failed} failed" if self.failed else ""

    def _write_line(self) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()
