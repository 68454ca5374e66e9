"""How much of this process's CPUs other processes used lately (Linux ``/proc/stat``).

The engine thread widens a long step to its whole OpenMP team only when no core of its CPU set is
taken (runtime/cpu_threads/thread_choice.py, ``StepThreads``): a team's threads meet at a barrier after every
op, so one partner that waits for a core held by another process stalls every op of the step. The
process's own threads are known by count (busy decode workers, encoder lanes); other processes only
through the kernel's per-CPU time:

    others = (busy jiffies of the CPUs we may run on, since the last sample) / USER_HZ
             - (this process's CPU seconds over the same window)
             -> CPUs' worth, over the window's wall seconds

``/proc/stat`` counts in ticks (10 ms at USER_HZ 100), so a sample spans at least ``min_window_s``
(0.1 s: a tick's error is then at most ~0.1 CPU); a caller asking sooner gets the last figure.
Where ``/proc/stat`` cannot be read (not Linux, a sandbox) the figure is 0: the engine then relies
on what it knows of its own threads.
"""

from __future__ import annotations

import os
import time
from typing import Callable

USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are not busy)


def busy_ticks(stat_text: str, cpus: frozenset[int]) -> int | None:
    """Busy ticks of the CPUs ``cpus`` summed from the per-CPU lines of ``/proc/stat`` text (None: no
    line for any of them)."""
    total, seen = 0, False
    for line in stat_text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields]
        total += sum(values[i] for i in BUSY_FIELDS if i < len(values))
        seen = True
    return total if seen else None


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


class HostCpu:
    """CPUs' worth of time other processes used on this process's CPUs over the last window."""

    def __init__(self, min_window_s: float = 0.1, *, read: Callable[[], str] = _read_stat,
                 clock: Callable[[], float] = time.monotonic, own_cpu: Callable[[], float] = time.process_time,
                 cpus: frozenset[int] | None = None) -> None:
        self.min_window_s = min_window_s
        self._read, self._clock, self._own_cpu = read, clock, own_cpu
        if cpus is None:
            cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))
        self.cpus = cpus
        self.last = 0.0  # the latest figure
        self._sample = self._take()

    def others(self) -> float:
        """Other processes' CPUs over the window ending now (or the last window, if it is younger
        than ``min_window_s``); 0 when /proc/stat cannot be read."""
        if self._sample is None or self._clock() - self._sample[0] < self.min_window_s:
            return self.last
        new = self._take()
        if new is None:
            return self.last
        (t0, ticks0, own0), (t1, ticks1, own1) = self._sample, new
        self._sample = new
        busy = (ticks1 - ticks0) / USER_HZ - (own1 - own0)
        self.last = max(0.0, busy / max(t1 - t0, 1e-9))
        return self.last

    def _take(self) -> tuple[float, int, float] | None:
        try:
            ticks = busy_ticks(self._read(), self.cpus)
        except (OSError, ValueError):
            return None
        if ticks is None:
            return None
        return self._clock(), ticks, self._own_cpu()
