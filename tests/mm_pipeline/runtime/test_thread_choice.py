"""Intra-op thread counts chosen by measurement (mm_pipeline/runtime/cpu_threads/thread_choice.py): the faster
count wins (more threads only by a margin), on the measuring thread and once; a probe that cannot
run or fails keeps the fallback; the config and flags (``--llm-threads``, ``--encoder-threads``);
the runtime's plan per setting; media worker threads run torch at one thread; and greedy tokens do
not depend on the counts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from mm_pipeline import cli
from mm_pipeline.media.worker_pool import WorkerPool
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.runtime.cpu_threads.thread_choice import ProbedThreads, ProbeUnavailable, ThreadChoice, measure_threads


class FakeClock:
    """Time that passes only while ``work`` runs: ``cost[n]`` per call at n intra-op threads."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.calls = cost, 0.0, {n: 0 for n in cost}

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        n = torch.get_num_threads()
        self.calls[n] += 1
        self.now += self.cost[n]


def on_a_thread(fn):
    """Run ``fn`` on a fresh thread (its intra-op count is its own) and return what it returned
    and the count the thread was left at."""
    out: list = []
    t = threading.Thread(target=lambda: out.append((fn(), torch.get_num_threads())))
    t.start()
    t.join()
    return out[0]


@pytest.mark.parametrize("cost, chosen", [({1: 0.010, 2: 0.006}, 2),   # 2 clearly faster
                                          ({1: 0.010, 2: 0.0098}, 1),  # within the margin: fewer threads
                                          ({1: 0.010, 2: 0.014}, 1),   # 2 slower (the 2-core host)
                                          ({1: 0.010, 2: 0.009, 4: 0.005}, 4)])
def test_the_faster_count_wins_and_the_thread_keeps_it(cost, chosen):
    clock = FakeClock(cost)
    choice, left_at = on_a_thread(lambda: measure_threads(clock.work, tuple(cost), rounds=3, budget_s=10,
                                                          clock=clock))
    assert choice.threads == chosen and left_at == chosen and choice.how == "measured"
    assert choice.best_ms == pytest.approx({n: c * 1e3 for n, c in cost.items()})
    assert all(c == 6 for c in clock.calls.values())  # 3 rounds: per count an untimed run, then a timed one
    assert choice.seconds == pytest.approx(6 * sum(cost.values()))  # every run counts, untimed ones too
    assert choice.describe().startswith(f"{chosen} (measured in ")


def test_the_budget_ends_the_rounds_early():
    clock = FakeClock({1: 0.2, 2: 0.3})
    choice, _ = on_a_thread(lambda: measure_threads(clock.work, (1, 2), rounds=5, budget_s=0.6, clock=clock))
    assert clock.calls == {1: 2, 2: 2} and choice.threads == 1  # one round (1 s), then past the budget


def test_bad_candidates():
    with pytest.raises(ValueError, match="candidates"):
        measure_threads(lambda: None, (2, 1))
    with pytest.raises(ValueError, match="candidates"):
        measure_threads(lambda: None, (0, 1))
    with pytest.raises(ValueError, match="rounds"):
        measure_threads(lambda: None, (1, 2), rounds=0)


def test_a_probe_measures_once_and_a_failing_one_keeps_the_fallback():
    clock = FakeClock({1: 0.010, 2: 0.005})
    lock = threading.Lock()
    probe = ProbedThreads("engine thread", clock.work, (1, 2), lock, fallback=1)
    probe_clock = measure_threads.__kwdefaults__["clock"]
    measure_threads.__kwdefaults__["clock"] = clock  # the probe times with the fake clock
    try:
        assert on_a_thread(probe) == (2, 2) and probe.ready.is_set() and probe.choice.how == "measured"
        runs = dict(clock.calls)
        # asked again (on another thread): the same count, not measured again; only the measuring
        # thread's own count was set (intra_op.set_local_threads), the asker sets its own
        assert on_a_thread(probe)[0] == 2 and clock.calls == runs
    finally:
        measure_threads.__kwdefaults__["clock"] = probe_clock

    def unavailable():
        raise ProbeUnavailable("no pages")

    def broken():
        raise RuntimeError("boom")

    for work in (unavailable, broken):
        p = ProbedThreads("encoder", work, (1, 2), lock, fallback=2)
        assert on_a_thread(p) == (2, 2) and p.choice == ThreadChoice(2, "fixed") and p.ready.is_set()


def test_config_values_and_flags():
    cfg = OmniEngineConfig()
    assert cfg.llm_threads == "auto" and cfg.encoder_threads == "auto"
    cfg = cli.engine_config(cli.parse_args(["serve", "--model", "m", "--llm-threads", "2", "--encoder-threads", "1"]))
    assert cfg.llm_threads == 2 and cfg.encoder_threads == 1
    cfg = cli.engine_config(cli.parse_args(["serve", "--model", "m", "--llm-threads", "none", "--encoder-threads", "0"]))
    assert cfg.llm_threads is None and cfg.encoder_threads == 0
    assert OmniEngineConfig(llm_threads="3").llm_threads == 3  # the digits of a count are that count
    assert OmniEngineConfig().llm_team_min_rows == "auto"
    assert cli.engine_config(cli.parse_args(["serve", "--model", "m", "--llm-team-min-rows", "64"])).llm_team_min_rows == 64
    for bad in (0, "some", True, 1.5):
        with pytest.raises(ValueError, match="llm_team_min_rows"):
            OmniEngineConfig(llm_team_min_rows=bad)
    for bad in ({"llm_threads": 0}, {"llm_threads": "many"}, {"encoder_threads": -1}, {"encoder_threads": 1.5},
                {"llm_threads": True}):
        with pytest.raises(ValueError, match="threads must be auto, none or an integer"):
            OmniEngineConfig(**bad)
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--model", "m", "--llm-threads", "zero"])
    assert OmniEngineConfig().warm_up  # on by default; --no-warm-up turns it off
    assert not cli.engine_config(cli.parse_args(["serve", "--model", "m", "--no-warm-up"])).warm_up


def test_media_worker_threads_run_torch_at_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    pool = WorkerPool(2, 4)
    try:
        async def four() -> list[int]:
            return list(await asyncio.gather(*(pool.run(torch.get_num_threads) for _ in range(4))))

        counts = asyncio.run(asyncio.wait_for(four(), 30))
    finally:
        pool.shutdown()
        torch.set_num_threads(before)
    assert counts == [1, 1, 1, 1]


def test_tokens_do_not_depend_on_the_thread_counts(tmp_path_factory):
    """The serial path at one thread vs the encoder worker with each thread at 1, at 2, and measured
    ("auto", torch at 2 threads so both probes run): the same greedy tokens; the stats show the
    counts the threads run at."""
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
    from tests.mm_pipeline.runtime.test_encoder_worker import run_all

    ckpt = build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")
    before = torch.get_num_threads()
    runs, counts, said = {}, {}, {}
    try:
        for name, kw in {"serial": dict(encoder_worker=False, llm_threads=1), "one": dict(llm_threads=1, encoder_threads=1, encoder_lanes=1),
                         "two": dict(llm_threads=2, encoder_threads=2, encoder_lanes=1), "auto": {}}.items():
            torch.set_num_threads(2)
            runs[name], engine = run_all(ckpt, **kw)
            try:
                counts[name] = dict(engine.stats().intra_op_threads)
                said[name] = engine.runtime.describe_threads()
                if name == "auto":
                    probes = {p.name: p.choice for p in engine.runtime.probes}
            finally:
                engine.shutdown()
    finally:
        torch.set_num_threads(before)
    assert runs["one"] == runs["serial"] and runs["two"] == runs["serial"] and runs["auto"] == runs["serial"]
    assert counts["serial"] == {"engine": 1}
    assert counts["one"] == {"engine": 1, "encoder": 1} and counts["two"] == {"engine": 2, "encoder": 2}
    # beside a CPU LLM on "auto" the engine thread owns the one wide team: only it measures, and the
    # default two encoder lanes run at one thread each
    assert set(probes) == {"engine thread"} and probes["engine thread"].how == "measured"
    assert counts["auto"] == {"engine": probes["engine thread"].threads, "encoder": 1}
    assert said["one"] == "engine thread 1; encoder 1" and said["serial"] == "engine thread 1"
    assert said["auto"].startswith("engine thread ") and "; encoder 1" in said["auto"] and "measured in" in said["auto"] \
        and said["auto"].endswith("; 2 encoder lanes at 1 each")


# ---- the engine thread's count per step (StepThreads) and the loader thread -------------------------------
class FakeHostCpu:
    def __init__(self, others: float) -> None:
        self.value = others

    def others(self) -> float:
        return self.value


def test_a_long_step_on_free_cores_gets_the_team_and_anything_else_one_thread():
    from mm_pipeline.runtime.cpu_threads.thread_choice import StepThreads

    busy = [0]
    host = FakeHostCpu(0.0)
    steps = StepThreads(2, lambda: busy[0], host, min_rows=128)
    assert steps(4096) == 1  # wide not set yet (the engine thread sets it after its probe)
    steps.wide = 2
    assert steps(127) == 1 and steps(128) == 2 and steps(4096) == 2  # a decode step stays at one
    busy[0] = 1  # a decode worker or an encoder lane holds a core
    assert steps(512) == 1
    busy[0] = 0
    host.value = 0.6  # another process used most of a core lately
    assert steps(512) == 1
    host.value = 0.4
    assert steps(512) == 2
    assert steps.counts == {"wide_steps": 3, "narrowed_steps": 2}
    many = StepThreads(16, lambda: 3, None, min_rows=1)
    many.wide = 8
    assert many(64) == 8  # 16 - 3 leaves the team its cores
    with pytest.raises(ValueError, match="cpus >= 1"):
        StepThreads(0, lambda: 0)


class RowsClock:
    """Time that passes only while a probe runs: ``cost[rows][n]`` per scratch step of ``rows`` rows at
    n intra-op threads; ``probed`` lists the sizes asked for."""

    def __init__(self, cost: dict[int, dict[int, float]]) -> None:
        self.cost, self.now, self.probed = cost, 0.0, []

    def __call__(self) -> float:
        return self.now

    def probe(self, rows: int):
        self.probed.append(rows)

        def work() -> None:
            self.now += self.cost[rows][torch.get_num_threads()]
        return work


@pytest.mark.parametrize("cost,min_rows,probed", [
    ({128: {1: 11.0, 2: 7.0}, 32: {1: 4.0, 2: 3.0}}, 16, [128, 32]),  # the team wins short steps too
    ({128: {1: 11.0, 2: 7.0}, 32: {1: 4.0, 2: 4.1}}, 128, [128, 32]),  # only from 128 rows
    ({128: {1: 11.2, 2: 12.0}, 32: {1: 4.0, 2: 3.0}}, 256, [128]),  # the 2-core EPYC: not below the long probe
    ({128: {1: 11.0, 2: 10.6}, 32: {1: 4.0, 2: 3.0}}, 256, [128]),  # 4 % faster is not enough (PREFER_FEWER)
])
def test_the_rows_from_which_a_step_takes_the_team_are_measured(cost, min_rows, probed):
    """measure_min_rows: the larger short size first, each at 1 and the team as measure_threads times
    counts; one thread winning a size ends it (the smaller sizes are not timed)."""
    from mm_pipeline.runtime.cpu_threads.thread_choice import PROBE_ROWS, measure_min_rows

    clock = RowsClock(cost)
    (got, choices), _ = on_a_thread(lambda: measure_min_rows(clock.probe, 2, clock=clock))
    assert got == min_rows and clock.probed == probed and sorted(choices) == sorted(probed)
    assert PROBE_ROWS == 256
    with pytest.raises(ValueError, match="ascending"):
        measure_min_rows(clock.probe, 2, sizes=(128, 32))


def test_the_engine_thread_measures_its_short_steps_at_start_only_when_asked_and_keeps_the_value_on_failure(caplog):
    from mm_pipeline.runtime.cpu_threads.thread_choice import WIDE_MIN_ROWS, StepThreads

    clock = RowsClock({128: {1: 11.2, 2: 12.0}, 32: {1: 4.0, 2: 3.0}})
    steps = StepThreads(2, lambda: 0, FakeHostCpu(0.0), short_probe=clock.probe, clock=clock)
    assert steps.min_rows == WIDE_MIN_ROWS == 16  # until measured
    steps.start(1)  # no team: nothing to measure
    assert clock.probed == [] and steps.min_rows == 16
    on_a_thread(lambda: steps.start(2))
    assert steps.wide == 2 and steps.min_rows == 256 and clock.probed == [128]
    assert steps(255) == 1 and steps(256) == 2  # a 29-row prefill and a decode batch of 64 stay at one thread
    assert steps.describe().startswith("measured: 128 rows 1: ")
    fixed = StepThreads(2, lambda: 0, FakeHostCpu(0.0), min_rows=64)
    fixed.start(2)
    assert fixed.min_rows == 64 and fixed.describe() == ""

    def unavailable(rows):
        raise ProbeUnavailable("no pages")

    def broken(rows):
        return lambda: 1 / 0

    for probe in (unavailable, broken):
        kept = StepThreads(2, lambda: 0, None, min_rows=48, short_probe=probe)
        on_a_thread(lambda: kept.start(2))
        assert kept.min_rows == 48 and kept.wide == 2
    assert "measuring the engine thread's short steps failed" in caplog.text


def test_run_on_thread_returns_raises_and_its_team_ends_with_it():
    import os

    from mm_pipeline.runtime.cpu_threads.thread_choice import run_on_thread

    assert run_on_thread(lambda: 41 + 1, "t") == 42
    with pytest.raises(KeyError, match="boom"):
        run_on_thread(lambda: {}["boom"], "t")
    if not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs Linux /proc and 2 CPUs")

    def wide_ops() -> int:
        torch.set_num_threads(2)
        torch.nn.functional.silu(torch.randn(2000, 2000))  # 4M elements: a parallel op at 2 threads
        return len(os.listdir("/proc/self/task"))

    def settled() -> int:  # a thread leaves the task list shortly after it ends: wait for a steady count
        deadline, last = time.monotonic() + 5.0, -1
        while time.monotonic() < deadline:
            n = len(os.listdir("/proc/self/task"))
            if n == last:
                return n
            last = n
            time.sleep(0.05)
        return last

    run_on_thread(wide_ops, "t")  # once first: torch starts a thread of its own on first use
    before = settled()
    assert run_on_thread(wide_ops, "t") > before + 1  # the thread and its team's second thread
    assert settled() == before  # both gone: no idle team left behind


def test_wide_steps_and_the_warm_up_leave_the_tokens_unchanged(tmp_path_factory, monkeypatch):
    """The engine thread's team on long steps (forced: measured 2, every step long enough, nothing
    busy) gives the serial path's greedy tokens; the warm-up scratch step ran once, at the engine's
    max_num_batched_tokens, and left the pools as they were."""
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
    from llm_core.engine.llm_engine import LLMEngine
    from mm_pipeline.runtime.cpu_threads import thread_choice
    from tests.mm_pipeline.runtime.test_encoder_worker import run_all

    ckpt = build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")
    before = torch.get_num_threads()
    warmed = []
    probe = LLMEngine.probe_prefill
    monkeypatch.setattr(LLMEngine, "probe_prefill", lambda self, n: warmed.append(n) or probe(self, n))
    monkeypatch.setattr(thread_choice, "measure_threads",
                        lambda work, candidates, **kw: ThreadChoice(2, "measured", {1: 2.0, 2: 1.0}))
    try:
        torch.set_num_threads(1)
        serial, engine = run_all(ckpt, encoder_worker=False, llm_threads=1, warm_up=False)
        engine.shutdown()
        assert warmed == []
        torch.set_num_threads(2)
        original = thread_choice.StepThreads.__call__

        def every_step_wide(self, rows):  # the policy's rule with nothing busy and no row minimum
            self.busy, self.host, self.min_rows = (lambda: 0), None, 1
            return original(self, rows)

        monkeypatch.setattr(thread_choice.StepThreads, "__call__", every_step_wide)
        wide, engine = run_all(ckpt)
        try:
            stats = engine.stats()
            assert stats.engine_loop["wide_steps"] > 0 and stats.intra_op_threads["engine"] == 2
            assert warmed[0] == 64  # run_all's max_num_batched_tokens (under WARM_UP_MAX_ROWS), before the probe's runs
            assert engine.runtime.llm.pool.full.num_free == engine.runtime.llm.pool.full.num_pages or stats.llm
            # the short steps measured too (both won by the team here): the start-up line says how
            assert ("for steps of >= 1 rows (measured: 32 rows 1: 2.0 ms, 2: 1.0 ms; 128 rows 1: 2.0 ms, 2: 1.0 ms) "
                    "on free cores") in engine.runtime.describe_threads()
        finally:
            engine.shutdown()
    finally:
        torch.set_num_threads(before)
    assert wide == serial
