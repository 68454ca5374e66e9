"""The encoder deployment's Ray Serve request router: each media item goes to the encoder replica
its content key hashes to (mm_pipeline/cluster/serving/consistent_hash.py), so repeated media lands where it
is cached, with bounded loads so one hot video cannot pile every request onto one replica.

Load = encode calls this router has in flight on each replica. The ring is rebuilt when the set of
replicas changes; a replica that left moves only its own keys.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mm_pipeline.cluster.serving.consistent_hash import BoundedLoadRing
from mm_pipeline.cluster.serving.router_state import InflightWork

KEY_KWARG = "media_key"


class ContentHashRouter(RequestRouter):
    def initialize_state(self, epsilon: float = 0.25, vnodes: int = 64, **_: Any) -> None:
        self.epsilon, self.vnodes = epsilon, vnodes
        self._ring: BoundedLoadRing | None = None
        self._inflight = InflightWork()  # encode calls this router has on each replica

    def _ring_for(self, ids: list[str]) -> BoundedLoadRing:
        if self._ring is None or self._ring.replicas != sorted(ids):
            self._ring = BoundedLoadRing(ids, self.vnodes, self.epsilon)
        return self._ring

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        key = (pending_request.kwargs or {}).get(KEY_KWARG) if pending_request is not None else None
        rest = sorted(by_id, key=self._inflight.get)
        if not isinstance(key, str):
            return [[by_id[rid]] for rid in rest]
        first = self._ring_for(list(by_id)).choose(key, self._inflight.by_replica)
        return [[by_id[first]]] + [[by_id[rid]] for rid in rest if rid != first]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._inflight.routed(pending_request.metadata.internal_request_id, replica_id.unique_id, 1)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight.completed(internal_request_id)
