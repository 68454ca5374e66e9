"""Other processes' CPU use from /proc/stat (runtime/cpu_threads/host_cpu.py), on fake counters and clocks."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, strategies as st

from mm_pipeline.runtime.cpu_threads.host_cpu import USER_HZ, HostCpu, busy_ticks

STAT = """cpu  900 0 90 5000 10 0 0 0 0 0
cpu0 100 1 10 2000 5 2 3 4 0 0
cpu1 300 0 30 1000 5 0 0 0 0 0
cpu2 500 0 50 2000 0 0 0 0 0 0
intr 12345
ctxt 999
"""


def test_busy_ticks_sums_only_the_given_cpus_and_skips_idle():
    # cpu0: user nice system irq softirq steal = 100 + 1 + 10 + 2 + 3 + 4 (idle and iowait left out)
    assert busy_ticks(STAT, frozenset({0})) == 120
    assert busy_ticks(STAT, frozenset({0, 1})) == 120 + 330
    assert busy_ticks(STAT, frozenset({7})) is None  # no line for that CPU
    assert busy_ticks("cpu  1 2 3 4\nintr 5\n", frozenset({0})) is None  # the aggregate line alone


class FakeHost:
    """/proc/stat text whose cpu0 busy ticks, the clock and this process's CPU move as told."""

    def __init__(self):
        self.ticks, self.now, self.own = 0, 100.0, 0.0

    def read(self) -> str:
        return f"cpu  0 0 0 0\ncpu0 {self.ticks} 0 0 50 0 0 0 0\n"

    def host(self, window: float = 0.1) -> HostCpu:
        return HostCpu(window, read=self.read, clock=lambda: self.now, own_cpu=lambda: self.own, cpus=frozenset({0}))


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.1, 5.0))
def test_others_is_the_busy_time_minus_this_process_over_the_window(other, own, seconds):
    fake = FakeHost()
    host = fake.host(window=0.05)
    fake.now += seconds
    fake.own += own * seconds
    fake.ticks += round((other + own) * seconds * USER_HZ)
    got = host.others()
    assert got == pytest.approx(other, abs=1.0 / (USER_HZ * seconds) + 1e-9)  # one tick of rounding
    assert got >= 0.0


def test_a_young_window_gives_the_last_figure_and_an_unreadable_stat_gives_zero():
    fake = FakeHost()
    host = fake.host(window=0.1)
    fake.now += 0.5
    fake.ticks += USER_HZ // 2  # one CPU busy for the 0.5 s, not this process
    assert host.others() == pytest.approx(1.0)
    fake.now += 0.05
    fake.ticks += 1000  # inside the window: not sampled yet
    assert host.others() == pytest.approx(1.0)

    def broken() -> str:
        raise OSError("no /proc here")

    blind = HostCpu(read=broken, cpus=frozenset({0}))
    assert blind.others() == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc/stat")
def test_the_real_host_reads():
    host = HostCpu(min_window_s=0.0)
    assert host.others() >= 0.0
