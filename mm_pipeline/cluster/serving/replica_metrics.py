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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from prometheus_client.metrics_core import Metric

from mm_pipeline.server.metrics import PREFIX, SnapshotCollector

REPLICA_LABEL = "replica"
_AVAILABLE = PREFIX + "engine_stats_available"  # the server's own collector reports it


@dataclass(frozen=True)
class ReplicaStats:
    """The last snapshot of each LLM replica that answered a refresh (``OmniStats`` by Serve's
    replica id), and when the refresh ended (``time.monotonic()``)."""

    replicas: Mapping[str, Any]
    taken_at: float

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt + output one request can hold on any replica (one config for all)."""
        return min(s.llm.max_context_tokens for s in self.replicas.values())

    def to_dict(self) -> dict[str, Any]:
        """What ``/health`` returns: each replica's snapshot as a single engine's ``/health`` has it."""
        return {"replicas": {name: s.to_dict() for name, s in sorted(self.replicas.items())}}


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


def create_ingress_app(engine: Any, settings: Any) -> Any:
    """The app the ingress serves: ``create_app`` over ``engine`` (a ``RemoteEngine``), with the
    replicas' engine families added to its ``/metrics``."""
    from mm_pipeline.server.app import create_app

    app = create_app(engine, settings)
    app.state.metrics.registry.register(ReplicaMetrics(engine.stats))
    return app
