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

KEY_KWARG = "media_key"


class ContentHashRouter(RequestRouter):
    def initialize_state(self, epsilon: float = 0.25, vnodes: int = 64, **_: Any) -> None:
        self.epsilon, self.vnodes = epsilon, vnodes
        self._ring: BoundedLoadRing | None = None
        self._inflight: dict[str, int] = {}
        self._requests: dict[str, str] = {}

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
        rest = sorted(by_id, key=lambda rid: self._inflight.get(rid, 0))
        if not isinstance(key, str):
            return [[by_id[rid]] for rid in rest]
        first = self._ring_for(list(by_id)).choose(key, self._inflight)
        return [[by_id[first]]] + [[by_id[rid]] for rid in rest if rid != first]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        self._inflight[rid] = self._inflight.get(rid, 0) + 1
        self._requests[pending_request.metadata.internal_request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._requests.pop(internal_request_id, None)
        if rid is not None:
            self._inflight[rid] = max(0, self._inflight.get(rid, 0) - 1)
