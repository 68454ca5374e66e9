"""The ingress's stats refresh under ``--ray`` with a replica that is alive but silent (a hung engine
thread, a GC pause, a stuck actor): mm_pipeline/cluster/serving/replica_snapshots.py, without a
cluster (the broadcast is tests/support/serve_broadcast.py's stand-in).

The refresh gathered Serve's broadcast all or nothing: the silent replica held it to its deadline,
the other replicas' answers were thrown away, and after ``STATS_STALE_S`` ``stats()`` raised
(/health 503, /metrics without any replica's families) although every other replica was fine. Now
each answer is used as it arrives; the silent replica keeps its last snapshot, marked late and
named, until it is ``STATS_STALE_S`` old, then it is left out; only no replica answering at all
makes the deployment's stats stale."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

import pytest

pytest.importorskip("ray")  # RemoteEngine names Ray's error types

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from mm_pipeline.cluster.serving import remote_engine  # noqa: E402
from mm_pipeline.cluster.serving.remote_engine import RemoteEngine  # noqa: E402
from mm_pipeline.cluster.serving.replica_metrics import ReplicaMetrics  # noqa: E402
from tests.mm_pipeline.server.test_server_metrics import a_snapshot, samples  # noqa: E402
from tests.support.serve_broadcast import SILENT, AllOrNothing, Broadcast, ReplicaResult  # noqa: E402

DEADLINE_S, STALE_S = 0.2, 0.8


@pytest.fixture(autouse=True)
def fast_stats(monkeypatch):
    monkeypatch.setattr(remote_engine, "STATS_MAX_AGE_S", 0.05)
    monkeypatch.setattr(remote_engine, "STATS_STALE_S", STALE_S)
    monkeypatch.setattr(remote_engine, "STATS_TIMEOUT_S", DEADLINE_S)


class Replicas:
    """The LLM deployment's handle: ``broadcast("replica_stats")`` reaches every replica of ``names``;
    each answers its snapshot (generated tokens: the refresh's number), unless ``silent`` or ``slow``."""

    def __init__(self, names: list[str], response: type = Broadcast) -> None:
        self.names, self.response = names, response
        self.silent: set[str] = set()
        self.slow: dict[str, float] = {}
        self.sent: list[Broadcast] = []

    def broadcast(self, method: str) -> Broadcast:
        assert method == "replica_stats"
        n = len(self.sent) + 1
        self.sent.append(self.response([
            ReplicaResult(SILENT if name in self.silent else (name, a_snapshot(generation_tokens=n)),
                          self.slow.get(name, 0.0)) for name in self.names]))
        return self.sent[-1]


async def refresh(engine: RemoteEngine) -> None:
    """One refresh, bounded: all or nothing, one with a silent replica never returned (Serve's
    ``results_async`` without a timeout)."""
    await asyncio.wait_for(engine.refresh_stats(), 2.0)


def scrape(engine: RemoteEngine) -> dict:
    registry = CollectorRegistry()
    registry.register(ReplicaMetrics(engine.stats))
    return samples(generate_latest(registry).decode())


def test_the_installed_ray_has_per_replica_broadcast_results():
    """What replica_snapshots.gather_answers reads of Serve (the stand-in's surface): without it the
    refresh falls back to Serve's all-or-nothing collection."""
    from ray.serve._private.replica_result import ReplicaResult as RayReplicaResult
    from ray.serve.handle import DeploymentBroadcastResponse

    assert inspect.iscoroutinefunction(DeploymentBroadcastResponse._fetch_replica_results_async)
    assert inspect.iscoroutinefunction(RayReplicaResult.get_async) and callable(RayReplicaResult.cancel)


def test_a_silent_replica_keeps_its_last_snapshot_and_the_others_stay_current(monkeypatch, caplog):
    monkeypatch.setattr(remote_engine, "STATS_MAX_AGE_S", 60.0)  # no refresh in the background: the test's own
    caplog.set_level(logging.INFO, logger="mm_pipeline.cluster.serving.replica_snapshots")
    handle = Replicas(["replica-a", "replica-b", "replica-c"])
    engine = RemoteEngine(handle, None, "demo")
    a, b, c = ((("replica", name),) for name in handle.names)

    async def run() -> None:
        await refresh(engine)
        await asyncio.sleep(0.1)
        handle.silent, handle.slow = {"replica-b"}, {"replica-c": 0.05}
        start = time.monotonic()
        # all or nothing, this never returned, and within the refresh's deadline (STATS_TIMEOUT_S
        # around it) it raised and dropped replica-a's and replica-c's answers
        await refresh(engine)
        assert DEADLINE_S <= time.monotonic() - start < DEADLINE_S + 1.0  # at the deadline, not never
        stats = engine.stats()
        assert {n: s.llm.generation_tokens for n, s in stats.replicas.items()} == \
            {"replica-a": 2, "replica-b": 1, "replica-c": 2}  # replica-b's last snapshot kept
        assert stats.late == {"replica-b"} and stats.unanswered == 1
        # nothing left queued on the stuck replica
        assert [r.cancelled for r in handle.sent[-1].replica_results] == [False, True, False]
        assert "1 of 3 replicas did not answer" in caplog.text and "replica-b (last answered" in caplog.text

        got = scrape(engine)
        assert [got[("mmserve_replica_answered", r)] for r in (a, b, c)] == [1, 0, 1]
        ages = [got[("mmserve_replica_answer_age_seconds", r)] for r in (a, b, c)]
        assert ages[1] >= DEADLINE_S + 0.1 and ages[1] - ages[0] >= 0.09 and ages[1] - ages[2] >= 0.09
        assert got[("mmserve_replicas_unanswered", ())] == 1
        assert got[("mmserve_generation_tokens_total", b)] == 1 and got[("mmserve_generation_tokens_total", a)] == 2
        health = stats.to_dict()
        assert list(health["late"]) == ["replica-b"] and health["late"]["replica-b"] >= DEADLINE_S + 0.1
        assert health["unanswered"] == 1 and sorted(health["replicas"]) == handle.names

        # silent past STATS_STALE_S: left out and named; the deployment's stats stay current
        while time.monotonic() - start < STALE_S:
            await refresh(engine)
        stats = engine.stats()  # not stale: replica-a and replica-c answer
        assert sorted(stats.replicas) == ["replica-a", "replica-c"] and stats.late == frozenset()
        assert stats.unanswered == 1
        assert {s.llm.generation_tokens for s in stats.replicas.values()} == {len(handle.sent)}  # current
        assert "replica-b not answered for over" in caplog.text
        assert ("mmserve_replica_answered", b) not in scrape(engine)

        handle.silent = set()  # it answers again: back, current
        await refresh(engine)
        stats = engine.stats()
        assert sorted(stats.replicas) == handle.names and stats.unanswered == 0
        assert "every replica answered again" in caplog.text

    asyncio.run(run())


def test_rounds_after_a_silence_end_one_period_in_so_the_other_snapshots_stay_fresh(monkeypatch):
    """A hung replica held every refresh to its deadline (STATS_TIMEOUT_S, 5 s): the healthy replicas'
    snapshots were asked for once per deadline instead of once per STATS_MAX_AGE_S. The round after a
    silence ends one period in once only as many replicas as were silent are still out; when the
    silent one answers again, the round ends as soon as every replica has."""
    period = 0.05
    monkeypatch.setattr(remote_engine, "STATS_MAX_AGE_S", period)
    handle = Replicas(["replica-a", "replica-b", "replica-c"])
    engine = RemoteEngine(handle, None, "demo")

    async def timed_refresh() -> float:
        start = time.monotonic()
        await refresh(engine)
        return time.monotonic() - start

    async def run() -> None:
        assert await timed_refresh() < period  # every replica answers: no wait
        handle.silent = {"replica-b"}
        assert await timed_refresh() >= DEADLINE_S  # a new silence: the full deadline, as before
        for _ in range(3):
            took = await timed_refresh()
            assert period <= took < DEADLINE_S - 0.05  # one period, not the deadline
            stats = engine.stats()
            assert stats.late == {"replica-b"} and stats.unanswered == 1
            assert stats.replicas["replica-a"].llm.generation_tokens == len(handle.sent)  # current
        assert all(r.cancelled for r in (b.replica_results[1] for b in handle.sent[1:]))  # nothing left queued
        handle.silent = set()
        handle.slow = {"replica-b": period / 5}  # answers again, within the period
        assert await timed_refresh() < period
        stats = engine.stats()
        assert stats.late == frozenset() and stats.unanswered == 0
        assert {s.llm.generation_tokens for s in stats.replicas.values()} == {len(handle.sent)}
        handle.slow = {}
        handle.silent = {"replica-a", "replica-c"}  # a wider silence than the last round's: the deadline
        assert await timed_refresh() >= DEADLINE_S

    asyncio.run(run())


def test_only_no_replica_answering_makes_the_stats_stale_naming_the_silent_ones():
    handle = Replicas(["replica-a", "replica-b"])
    engine = RemoteEngine(handle, None, "demo")

    async def run() -> None:
        await refresh(engine)
        handle.silent = set(handle.names)
        with pytest.raises(TimeoutError, match=r"2 silent: replica-a \(last answered .* replica-b \(last"):
            await refresh(engine)
        stats = engine.stats()  # the last snapshots, each marked, until STATS_STALE_S
        assert stats.late == set(handle.names) and sorted(stats.replicas) == handle.names
        deadline = time.monotonic() + 3.0
        while True:
            try:
                engine.stats()  # starts the refreshes in the background, as /health does
            except RuntimeError as exc:
                assert "no LLM replica has answered" in str(exc) and "replica-b (last answered" in str(exc)
                break
            assert time.monotonic() < deadline, "stats() never went stale"
            await asyncio.sleep(0.05)
        engine._refreshing.cancel()

    asyncio.run(run())


def test_a_ray_without_per_replica_results_falls_back_to_all_or_nothing(monkeypatch, caplog):
    from mm_pipeline.cluster.serving import replica_snapshots

    monkeypatch.setattr(replica_snapshots, "_warned_all_or_nothing", False)
    handle = Replicas(["replica-a", "replica-b"], response=AllOrNothing)
    engine = RemoteEngine(handle, None, "demo")

    async def run() -> None:
        await refresh(engine)
        assert sorted(engine.stats().replicas) == handle.names
        assert "has no per-replica results" in caplog.text
        handle.silent = {"replica-b"}
        with pytest.raises(TimeoutError, match="not every LLM replica answered"):
            await refresh(engine)

    asyncio.run(run())
