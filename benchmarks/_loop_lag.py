"""Controls for benchmarks/pipeline.py's event-loop lag: was a stall the server's own work, or the
machine's?

* ``control_max_lag_ms``: the worst oversleep of a bare 5 ms sleeper in *another process*, running
  over the same window. Lag there is CPU starvation of the machine (other processes, a busy box);
  lag only in ours is this process (the GIL, a callback that ran too long, a collection).
* ``gc_max_pause_ms``: the longest garbage collection in this process over the window (a collection
  stops every Python thread, the event loop's too).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time

# ticks until a line arrives on stdin, then prints its worst oversleep in ms
_TICKER = r"""
import select, sys, time
worst = 0.0
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    time.sleep(0.005)
    worst = max(worst, time.perf_counter() - t0 - 0.005)
print(worst * 1000, flush=True)
"""


class LagControl:
    """``with LagControl() as c: ...`` then ``c.result()``: the controls over the block."""

    def __init__(self) -> None:
        self._pauses: list[float] = []
        self._gc_start = 0.0
        self._proc: subprocess.Popen | None = None
        self._out = ""

    def __enter__(self) -> "LagControl":
        gc.callbacks.append(self._on_gc)
        self._proc = subprocess.Popen([sys.executable, "-c", _TICKER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)  # the interpreter is up and ticking before the measured block starts
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        assert self._proc is not None
        self._out, _ = self._proc.communicate("stop\n", timeout=30)

    def result(self) -> dict[str, float]:
        return {"control_max_lag_ms": float(self._out.strip() or "nan"),
                "gc_max_pause_ms": max(self._pauses, default=0.0) * 1000}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._pauses.append(time.perf_counter() - self._gc_start)
