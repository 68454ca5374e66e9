"""Which LLM replica a request goes to: prefix and media affinity traded against load.

    score(r) = match_weight x matched(r) / prompt  -  load(r) / prompt

``matched(r)``: tokens of the request's leading blocks the router already sent to ``r`` (the radix
tree of dispatched prefixes, mm_pipeline/cluster/serving/router_state.py), media blocks included, so a
conversation's next turn and a new question about the same video score high where their KV is.
``load(r)``: queued + running work on ``r`` in tokens still to compute (reported by the replica,
or counted by the router).
Load is normalised by the request's own prompt, so both terms are in the same unit: at
``match_weight`` 1 the score is minus (tokens to prefill here + tokens queued ahead here), the
replica that finishes the request first; above 1 a cached token is worth more than a queued one
(it also saves KV space and keeps the prefix warm). Normalising by the busiest replica instead lets
a shared system prompt outweigh any queue: every conversation piles onto the first replica
(benchmarks/router.py measured a 2.0 balance, i.e. one replica idle, before this choice).
Ties go to the less loaded replica, then to a hash of the request's first block (rendezvous), which
spreads new conversations evenly yet sends the same first block to the same replica.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

from mm_pipeline.cluster.serving.route_key import RouteKey
from mm_pipeline.cluster.serving.router_state import PrefixIndex


@dataclass(frozen=True)
class AffinityConfig:
    match_weight: float = 1.5
    # a replica with this many times the mean load is skipped while another is under it, however
    # good its match: a hot prefix must not pile every request onto one replica
    max_load_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.match_weight < 0 or self.max_load_ratio < 1:
            raise ValueError(f"need match_weight >= 0 and max_load_ratio >= 1, got {self}")


def _rendezvous(first: int, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{first}:{replica}".encode(), digest_size=8).digest(), "little")


class AffinityPolicy:
    def __init__(self, index: PrefixIndex, config: AffinityConfig = AffinityConfig()) -> None:
        self.index, self.config = index, config

    def scores(self, key: RouteKey, loads: Mapping[str, float],
               matched: Mapping[str, int] | None = None) -> dict[str, float]:
        """``matched``: blocks matched per replica, when the caller already looked them up (the
        router, with the awaited ``index.lookup``); else ``index.match`` now, which may wait on I/O."""
        matched = self.index.match(key.hashes, loads) if matched is None else matched
        total = key.total or 1
        return {r: (self.config.match_weight * key.weight_of(matched[r]) - loads[r]) / total for r in loads}

    def rank(self, key: RouteKey, loads: Mapping[str, float], matched: Mapping[str, int] | None = None) -> list[str]:
        """Candidates best first (the router tries them in this order)."""
        if not loads:
            return []
        scores = self.scores(key, loads, matched)
        mean = sum(loads.values()) / len(loads)
        limit = self.config.max_load_ratio * max(mean, 1.0)
        first = key.hashes[0] if key.hashes else 0
        return sorted(loads, key=lambda r: (loads[r] > limit, -scores[r], loads[r], _rendezvous(first, r)))

    def dispatched(self, replica: str, key: RouteKey) -> None:
        self.index.record(replica, key.hashes)

    def forget(self, replicas: Sequence[str]) -> None:
        for r in replicas:
            self.index.forget(r)
