"""Controls for benchmarks/pipeline.py's event-loop lag: was a stall the server's own work, or the
machine's?

* ``control_max_lag_ms``: the worst oversleep of a bare 5 ms sleeper in *another process*, running
  over the same window. Lag there is CPU starvation of the machine (other processes, a busy box);
  lag only in ours is this process (the GIL, a callback that ran too long, a collection).
* ``gc_max_pause_ms``: the longest garbage collection in this process over the window (a collection
  stops every Python thread, the event loop's too).
* ``stalls_over_goal``: stalls longer than the goal (50 ms); for each, a sampler thread in this
  process records where every thread was, every 10 ms of the stall, and the block prints them
  (``tick()`` is called by the measured loop on each wake-up). A loop thread found inside a callback
  names what ran on the loop; one found in ``select`` while another thread runs Python names the
  thread that held the GIL.
"""

from __future__ import annotations

import collections
import gc
import subprocess
import sys
import threading
import time
import traceback

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


GOAL_S = 0.050  # issue 16's max_loop_lag_ms goal
SAMPLE_EVERY_S = 0.010


class LagControl:
    """``with LagControl() as c: ...`` then ``c.result()``: the controls over the block."""

    def __init__(self) -> None:
        self._pauses: list[float] = []
        self._gc_start = 0.0
        self._proc: subprocess.Popen | None = None
        self._out = ""
        self._last_tick: float | None = None  # no stall before the measured loop's first tick
        self._loop_thread = 0
        self._stalls: list[tuple[float, list[dict[str, str]]]] = []  # (length s, samples of every thread)
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="lag-sampler", daemon=True)

    def __enter__(self) -> "LagControl":
        gc.callbacks.append(self._on_gc)
        self._proc = subprocess.Popen([sys.executable, "-c", _TICKER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)  # the interpreter is up and ticking before the measured block starts
        self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        self._stop.set()
        self._sampler.join()
        assert self._proc is not None
        self._out, _ = self._proc.communicate("stop\n", timeout=30)
        self._print_stalls()

    def tick(self) -> None:
        """The measured loop woke up (call it from the loop's thread)."""
        self._last_tick = time.perf_counter()
        self._loop_thread = threading.get_ident()

    def result(self) -> dict[str, float]:
        return {"control_max_lag_ms": float(self._out.strip() or "nan"),
                "gc_max_pause_ms": max(self._pauses, default=0.0) * 1000,
                "stalls_over_goal": float(sum(length > GOAL_S for length, _ in self._stalls))}

    def _sample(self) -> None:
        """While a tick is overdue by more than the sampling period, every period: where each thread is."""
        stall_of, samples = None, []
        while not self._stop.wait(SAMPLE_EVERY_S / 5):
            last = self._last_tick
            if last is None:  # the measured loop has not started: its set-up is no stall
                continue
            overdue = time.perf_counter() - last
            if stall_of is not None and last != stall_of:  # the loop woke up: the stall is over
                self._stalls.append((samples[-1]["_overdue"], samples))
                stall_of, samples = None, []
            if overdue > SAMPLE_EVERY_S * (len(samples) + 1):
                stall_of = last
                samples.append(self._where(overdue))

    def _where(self, overdue: float) -> dict[str, float | str]:
        names = {t.ident: t.name for t in threading.enumerate()}
        sample: dict = {"_overdue": overdue}
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            top = traceback.extract_stack(frame)[-3:]
            name = ("LOOP " if ident == self._loop_thread else "") + names.get(ident, str(ident))
            sample[name] = " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(top))
        return sample

    def _print_stalls(self) -> None:
        for length, samples in self._stalls:
            if length <= GOAL_S:
                continue
            print(f"event-loop stall of >= {length * 1e3:.0f} ms; each thread's innermost frames in "
                  f"{len(samples)} samples, the most frequent first:", flush=True)
            seen: collections.Counter = collections.Counter()
            for sample in samples:
                seen.update((name, where) for name, where in sample.items() if name != "_overdue")
            for (name, where), n in sorted(seen.items(), key=lambda kv: (not kv[0][0].startswith("LOOP"), -kv[1])):
                print(f"  {n:3d}x {name}: {where}", flush=True)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._pauses.append(time.perf_counter() - self._gc_start)
