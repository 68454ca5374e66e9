"""The ingress's engine metrics under ``--ray`` (mm_pipeline/cluster/serving/replica_metrics.py),
without a cluster (the DeploymentHandle is a stand-in of two LLM replicas): every replica's
snapshot, each family labelled with its replica, so no counter goes backwards between scrapes
(they jumped between whichever replica answered: 10000, 10000, 300, 10000); /health names each
replica's snapshot; a replica whose answer fails is left out; none answering is no snapshot; the
ingress's start waits for a replica."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

pytest.importorskip("ray")  # RemoteEngine names Ray's error types

from mm_pipeline.cluster.serving.remote_engine import RemoteEngine  # noqa: E402
from mm_pipeline.server.settings import ServerSettings  # noqa: E402
from tests.mm_pipeline.server.test_server_metrics import a_snapshot, samples  # noqa: E402
from tests.support.serve_broadcast import Broadcast  # noqa: E402

REPLICAS = {"replica-a": a_snapshot(generation_tokens=10_000, prompt_tokens=50_000, preemptions=7, running=2),
            "replica-b": a_snapshot(generation_tokens=300, prompt_tokens=900, preemptions=0, running=1)}


class TwoReplicas:
    """The LLM deployment's handle: a routed ``stats`` call reaches one replica or the other (the
    least loaded), ``broadcast`` reaches both."""

    def __init__(self) -> None:
        self.calls, self.failing = 0, set()
        self.stats = self

    def remote(self) -> Any:  # handle.stats.remote(): routed
        name = sorted(REPLICAS)[self.calls % 2]
        self.calls += 1

        async def answer() -> Any:
            return dataclasses.replace(REPLICAS[name], taken_at=time.monotonic())
        return answer()

    def broadcast(self, method: str) -> Broadcast:
        assert method == "replica_stats"
        return Broadcast([RuntimeError(f"{name} is gone") if name in self.failing
                          else (name, dataclasses.replace(s, taken_at=time.monotonic()))
                          for name, s in REPLICAS.items()])


def test_each_replica_has_its_own_series_and_no_counter_goes_backwards(monkeypatch):
    from fastapi.testclient import TestClient

    from mm_pipeline.cluster.serving import remote_engine
    from mm_pipeline.cluster.serving.replica_metrics import create_ingress_app

    monkeypatch.setattr(remote_engine, "STATS_MAX_AGE_S", 0.0)  # every scrape asks again
    handle = TwoReplicas()
    engine = RemoteEngine(handle, None, "demo")
    asyncio.run(engine.refresh_stats())
    with TestClient(create_ingress_app(engine, ServerSettings(model_name="demo"))) as client:
        scrapes = []
        for _ in range(4):
            scrapes.append(samples(client.get("/metrics").text))
            time.sleep(0.05)  # the refresh the scrape started lands
        for got in scrapes:
            assert got[("mmserve_engine_stats_available", ())] == 1
            for name, s in REPLICAS.items():
                labels = (("replica", name),)
                assert got[("mmserve_generation_tokens_total", labels)] == s.llm.generation_tokens
                assert got[("mmserve_prompt_tokens_total", labels)] == s.llm.prompt_tokens
                assert got[("mmserve_preemptions_total", labels)] == s.llm.preemptions
                assert got[("mmserve_running", labels)] == s.llm.running
                assert got[("mmserve_kv_pool_used_pages", (("pool", "full"), ("replica", name)))] == 5
            # no engine sample without its replica: no series that jumps between replicas
            assert not [k for k in got if k[0].startswith("mmserve_") and k[0] != "mmserve_engine_stats_available"
                        and "replica" not in dict(k[1]) and not _ingress_own(k[0])]
        health = client.get("/health").json()
        assert health["status"] == "ok" and sorted(health["stats"]["replicas"]) == sorted(REPLICAS)
        assert health["stats"]["replicas"]["replica-a"]["llm"]["generation_tokens"] == 10_000

        handle.failing = {"replica-b"}  # dying: left out, its series ends; the other goes on
        time.sleep(0.05)
        client.get("/metrics")
        time.sleep(0.05)
        got = samples(client.get("/metrics").text)
        assert got[("mmserve_generation_tokens_total", (("replica", "replica-a"),))] == 10_000
        assert ("mmserve_generation_tokens_total", (("replica", "replica-b"),)) not in got
    assert engine.max_model_len == 64


def _ingress_own(name: str) -> bool:
    """The ingress's own families (HTTP requests, latencies, its event loop, its stats refresh), not an
    engine's."""
    own = ("mmserve_requests", "mmserve_request_", "mmserve_time_", "mmserve_e2e_", "mmserve_inter_token_", "mmserve_event_loop_",
           "mmserve_http_", "mmserve_replicas_unanswered")
    return name.startswith(own)


def test_the_ingress_waits_for_a_replica_before_its_first_broadcast():
    """Serve may start the ingress before the LLM replicas: a broadcast to none raises at once (the
    ingress's start failed, and Serve started it again), a routed call waits for a replica."""

    class Starting(TwoReplicas):
        up = False

        def remote(self) -> Any:
            async def answer() -> Any:
                await asyncio.sleep(0.05)  # Serve starts the replicas
                self.up = True
                return REPLICAS["replica-a"]
            return answer()

        def broadcast(self, method: str) -> Broadcast:
            if not self.up:
                raise RuntimeError("Deployment(name='LLM') has no replicas")  # DeploymentUnavailableError
            return super().broadcast(method)

    engine = RemoteEngine(Starting(), None, "demo")
    asyncio.run(engine.wait_for_replicas())
    assert sorted(engine.stats().replicas) == sorted(REPLICAS)


def test_no_replica_answering_fails_the_refresh():
    handle = TwoReplicas()
    handle.failing = set(REPLICAS)
    engine = RemoteEngine(handle, None, "demo")
    with pytest.raises(RuntimeError, match="is gone"):
        asyncio.run(engine.refresh_stats())
