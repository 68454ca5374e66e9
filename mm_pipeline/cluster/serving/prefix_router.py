"""The LLM deployment's Ray Serve request router: :class:`AffinityPolicy` behind Serve's
``RequestRouter`` interface (``request_router_config=RequestRouterConfig(request_router_class=...)``).

Serve gives every handle to the LLM deployment its own router instance (in the ingress replicas);
this one ranks the live replicas by the affinity score for the request's :class:`RouteKey` (passed
as the ``route`` keyword of the call) and Serve sends the request to the first rank with room
(``max_ongoing_requests``), probing queue lengths and backing off as it does for its own routers.
What each router dispatched goes into the shared prefix index (Redis when ``redis_url`` is given),
so every ingress replica sees the others' dispatches and a restarted ingress keeps them. Serve runs
this router on the handle's event loop, so no Redis round trip is made here: the lookup is awaited
on the index's reader thread (bounded; a timeout is a miss, routing by load), and the writes from the
sync callbacks (``on_request_routed``, a replica gone) are queued for its writer thread
(mm_pipeline/cluster/serving/router_state.py).

Load of a replica = max(what it last reported -- ``record_routing_stats``: tokens still to compute,
prompts not yet prefilled and tokens not yet decoded --, the prefill this router sent it and has not
seen finish: the prompt minus what the tree says is cached there). The report covers other
ingresses' requests but lags by ``request_routing_stats_period_s``; the local count is current for
this router's own; the max counts the requests both see once.

A replica that dies or leaves (``on_replica_actor_died`` / ``update_replicas``) is forgotten: its
nodes leave the tree, so nothing is routed to a cache that no longer exists. A replica whose engine
stopped is still alive as an actor until Serve's health check replaces it; it reports itself
unusable (``engine_stopped``, infinite load) and a resend names it in ``avoid``: both routers skip
such a replica while another one is left (its prefix match would otherwise send the resend straight
back to it).
"""

from __future__ import annotations

import logging
import math
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mm_pipeline.cluster.serving.affinity_policy import AffinityConfig, AffinityPolicy
from mm_pipeline.cluster.serving.route_key import RouteKey
from mm_pipeline.cluster.serving.router_state import InflightWork, MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex

log = logging.getLogger(__name__)

ROUTE_KWARG = "route"
AVOID_KWARG = "avoid"


def index_for(redis_url: str | None, ttl_s: int = 3600) -> PrefixIndex:
    return RedisPrefixIndex(redis_url, ttl_s=ttl_s) if redis_url else MemoryPrefixIndex(max_blocks_per_replica=1 << 16)


def route_of(pending: Optional[PendingRequest]) -> RouteKey | None:
    if pending is None:
        return None
    key = (pending.kwargs or {}).get(ROUTE_KWARG)
    return key if isinstance(key, RouteKey) else None


def usable(candidates: List[RunningReplica], pending: Optional[PendingRequest]) -> List[RunningReplica]:
    """The candidates that can serve: not stopped (as last reported), not named in the request's
    ``avoid``; all of them when none is left (the request then fails fast and the ingress says 503)."""
    avoid = set((pending.kwargs or {}).get(AVOID_KWARG) or ()) if pending is not None else set()

    def ok(r: RunningReplica) -> bool:
        stats = r.routing_stats or {}
        return (r.replica_id.unique_id not in avoid and not stats.get("engine_stopped")
                and math.isfinite(stats.get("load_tokens", 0)))
    return [r for r in candidates if ok(r)] or candidates


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, redis_url: str | None = None, match_weight: float = 1.5,
                         max_load_ratio: float = 4.0, ttl_s: int = 3600, **_: Any) -> None:
        self.policy = AffinityPolicy(index_for(redis_url, ttl_s), AffinityConfig(match_weight, max_load_ratio))
        self._inflight = InflightWork()  # prefill tokens this router has on each replica
        self._matched: dict[str, dict[str, int]] = {}  # internal request id -> cached tokens per replica
        self._known: set[str] = set()

    def _load(self, r: RunningReplica) -> float:
        reported = (r.routing_stats or {}).get("load_tokens", 0)
        return float(max(reported, self._inflight.get(r.replica_id.unique_id)))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in usable(candidate_replicas, pending_request)}
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        key = route_of(pending_request)
        if key is None:  # no prompt to match (stats, health): least loaded first
            return [[by_id[rid]] for rid in sorted(loads, key=loads.get)]
        matched = await self.policy.index.lookup(key.hashes, loads)  # off this loop; a timeout is a miss
        if pending_request is not None:
            while len(self._matched) >= 4096:  # requests cancelled before routing never pop theirs
                self._matched.pop(next(iter(self._matched)))
            self._matched[pending_request.metadata.internal_request_id] = {
                rid: key.weight_of(n) for rid, n in matched.items()}
        return [[by_id[rid]] for rid in self.policy.rank(key, loads, matched)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = route_of(pending_request)
        if key is None:
            return
        rid = replica_id.unique_id
        request = pending_request.metadata.internal_request_id
        work = key.total - self._matched.pop(request, {}).get(rid, 0)  # the prefill it sends there
        self.policy.dispatched(rid, key)
        self._inflight.routed(request, rid, work)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._matched.pop(internal_request_id, None)
        self._inflight.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop([replica_id.unique_id])

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        now = {r.replica_id.unique_id for r in replicas}
        self._drop(sorted(self._known - now))
        self._known = now

    def _drop(self, gone: list[str]) -> None:
        if gone:
            log.info("router forgets replicas %s", gone)
            self.policy.forget(gone)
            self._inflight.forget(gone)


class RoundRobinRouter(RequestRouter):
    """Replicas in turn, whatever the prompt: the baseline the affinity router is measured against
    (``--router round_robin``; benchmarks/router.py)."""

    def initialize_state(self, **_: Any) -> None:
        self._next = 0

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        ordered = sorted(usable(candidate_replicas, pending_request), key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        start = self._next % len(ordered)
        self._next += 1
        return [[r] for r in ordered[start:] + ordered[:start]]
