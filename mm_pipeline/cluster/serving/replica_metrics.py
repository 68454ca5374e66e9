"""The LLM replicas' engine statistics on the ingress: every replica's snapshot, each labelled.

    ingress  RemoteEngine.refresh_stats ── handle.broadcast("replica_stats") ──► every LLM replica
                 ◄── (replica id, OmniStats) each ───────────────────────────────┘
             /health   {"stats": {"replicas": {id: snapshot}}}
             /metrics  the engine families of each replica, with replica="<id>" (ReplicaMetrics);
                       the server's own collector sees no single engine and exports only
                       mmserve_engine_stats_available

The ingress used to ask one replica (whichever the router picked), and /metrics showed that
replica's counters without saying which: they jumped between replicas' values from scrape to scrape
(10000, 300, 10000), which Prometheus reads as counter resets. A series per replica keeps every
counter monotonic; ``sum by`` (without ``replica``) gives the cluster. A replica replaced by Serve
starts a new series under its new id.

A replica that did not answer the last refresh by its deadline (replica_snapshots.py) keeps its
last snapshot for a while: its series go on with those values, and three gauges say so, on the
ingress's clock (the snapshots' own ``stats_age_seconds`` is the replica's clock against the
ingress's, which only agree on one host):

    mmserve_replica_answered{replica}             1: answered the last refresh; 0: kept from an earlier one
    mmserve_replica_answer_age_seconds{replica}   since its snapshot reached the ingress
    mmserve_replicas_unanswered                   replicas the last refresh asked that did not answer by its
                                                  deadline (one never heard from has no series to say it)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from mm_pipeline.server.metrics import PREFIX, SnapshotCollector

REPLICA_LABEL = "replica"
_AVAILABLE = PREFIX + "engine_stats_available"  # the server's own collector reports it


@dataclass(frozen=True)
class ReplicaStats:
    """The last snapshot of each LLM replica (``OmniStats`` by Serve's replica id) and when this view
    was built (``time.monotonic()``). ``answered_at``: when each snapshot reached the ingress (its
    clock); ``late``: the replicas whose snapshot is kept from an earlier refresh (they did not
    answer the last one by its deadline); ``unanswered``: how many replicas the last refresh asked
    did not answer by its deadline."""

    replicas: Mapping[str, Any]
    taken_at: float
    answered_at: Mapping[str, float] = field(default_factory=dict)
    late: frozenset[str] = frozenset()
    unanswered: int = 0

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt + output one request can hold on any replica (one config for all)."""
        return min(s.llm.max_context_tokens for s in self.replicas.values())

    def answer_age_s(self, name: str, now: float | None = None) -> float:
        """Seconds since replica ``name``'s snapshot reached the ingress."""
        return (time.monotonic() if now is None else now) - self.answered_at.get(name, self.taken_at)

    def to_dict(self) -> dict[str, Any]:
        """What ``/health`` returns: each replica's snapshot as a single engine's ``/health`` has it,
        and the replicas kept from an earlier refresh with the seconds since each answered."""
        now = time.monotonic()
        return {"replicas": {name: s.to_dict() for name, s in sorted(self.replicas.items())},
                "late": {name: round(self.answer_age_s(name, now), 3) for name in sorted(self.late)},
                "unanswered": self.unanswered}


class ReplicaMetrics:
    """A Prometheus collector: the engine families of every replica in ``snapshot()`` (a
    ``ReplicaStats``), each sample labelled with its replica. Nothing when the snapshot cannot be
    had (no replica answered for a while: ``engine_stats_available`` says 0 then)."""

    def __init__(self, snapshot: Callable[[], ReplicaStats]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # names depend on the snapshots

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.snapshot()
        except Exception:  # noqa: BLE001 -- the server's collector reports it (engine_stats_available 0)
            return
        families: dict[str, Metric] = {}
        for name, snapshot in sorted(stats.replicas.items()):
            # one engine's families, exactly as a single-process server exports them
            for family in SnapshotCollector(lambda s=snapshot: s).collect():
                if family.name == _AVAILABLE:
                    continue
                out = families.get(family.name)
                if out is None:
                    out = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                         family.unit)
                out.samples.extend(s._replace(labels={**s.labels, REPLICA_LABEL: name}) for s in family.samples)
        yield from families.values()
        yield from _answer_families(stats)


def _answer_families(stats: ReplicaStats) -> Iterator[Metric]:
    """Which replicas answered the last refresh, and how old each one's snapshot is."""
    now = time.monotonic()
    answered = GaugeMetricFamily(PREFIX + "replica_answered", "1 when the LLM replica answered the ingress's last "
                                 "stats refresh, 0 when its snapshot is kept from an earlier one",
                                 labels=[REPLICA_LABEL])
    age = GaugeMetricFamily(PREFIX + "replica_answer_age_seconds", "Seconds since the LLM replica's stats snapshot "
                            "reached the ingress (the ingress's clock)", labels=[REPLICA_LABEL])
    for name in sorted(stats.replicas):
        answered.add_metric([name], 0 if name in stats.late else 1)
        age.add_metric([name], stats.answer_age_s(name, now))
    yield answered
    yield age
    yield GaugeMetricFamily(PREFIX + "replicas_unanswered", "LLM replicas the ingress's last stats refresh asked "
                            "that did not answer by its deadline", value=stats.unanswered)


def create_ingress_app(engine: Any, settings: Any) -> Any:
    """The app the ingress serves: ``create_app`` over ``engine`` (a ``RemoteEngine``), with the
    replicas' engine families added to its ``/metrics``."""
    from mm_pipeline.server.app import create_app

    app = create_app(engine, settings)
    app.state.metrics.registry.register(ReplicaMetrics(engine.stats))
    return app
