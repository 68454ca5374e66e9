"""What one replica of a distributed job did: items, throughput, cache hits, restarts, its timeline.

The driver builds one ``ReplicaStats`` per replica from the batch reports the replicas send back
with their rows (``add_batch``); the job summaries print them as a table under the totals:

    replica   node        items  failed  items/s  restarts  cache hits
    3f2a9c1e  10.0.0.5       40       1     2.31         0  encoder_cache_hits.redis=12, ...

Throughput is items over the time the replica was busy (the union of its batches' spans), so a
replica that started late or sat idle is not charged for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass
class ReplicaStats:
    replica: str  # the actor's id (kept across Ray restarts)
    node: str = ""
    items: int = 0
    failed: int = 0
    pids: set[int] = field(default_factory=set)  # one per incarnation: a restart adds one
    # cumulative counters per incarnation (pid): counters restart from 0 with the process
    cache_by_pid: dict[int, dict[str, int]] = field(default_factory=dict)
    timeline: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, items) per batch
    latest_start: float = float("-inf")  # of the batches added: ``node`` is where the latest ran

    def add_batch(self, *, node: str, pid: int, start: float, end: float, items: int, failed: int,
                  cache: Mapping[str, int]) -> None:
        """Count one batch report.  Reports may come in any order (the driver adds them as they
        arrive), and one batch may come in pieces (rows Ray Data split across blocks): the counts
        add up either way, and a piece's span repeats its batch's, which ``busy_s`` counts once."""
        if start >= self.latest_start:  # a restarted replica may run on another node: the newest wins
            self.node, self.latest_start = node, start
        self.items += items
        self.failed += failed
        self.pids.add(pid)
        seen = self.cache_by_pid.setdefault(pid, {})
        for k, v in cache.items():  # batches of one process may report out of order: keep the largest
            seen[k] = max(seen.get(k, 0), int(v))
        self.timeline.append((start, end, items))

    @property
    def restarts(self) -> int:
        return max(0, len(self.pids) - 1)

    @property
    def cache(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for counters in self.cache_by_pid.values():
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
        return total

    @property
    def busy_s(self) -> float:
        """Wall time with at least one batch of this replica running (overlapping batches count once)."""
        busy, end = 0.0, float("-inf")
        for s, e, _ in sorted(self.timeline):
            if e > end:
                busy += e - max(s, end)
                end = e
        return busy

    @property
    def items_per_s(self) -> float:
        return self.items / self.busy_s if self.busy_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"replica": self.replica, "node": self.node, "items": self.items, "failed": self.failed,
                "items_per_s": round(self.items_per_s, 3), "busy_s": round(self.busy_s, 3),
                "restarts": self.restarts, "cache_hits": self.cache,
                "timeline": [[round(s, 3), round(e, 3), n] for s, e, n in sorted(self.timeline)]}

    @staticmethod
    def table(replicas: list["ReplicaStats"]) -> list[str]:
        """Summary lines (none without replicas)."""
        if not replicas:
            return []
        out = [f"{'replica':<10}{'node':<16}{'items':>6}{'failed':>8}{'items/s':>9}{'restarts':>10}  cache hits"]
        for r in sorted(replicas, key=lambda r: r.replica):
            hits = ", ".join(f"{k}={v}" for k, v in sorted(r.cache.items()) if v) or "-"
            out.append(f"{r.replica[:8]:<10}{r.node[:15]:<16}{r.items:>6}{r.failed:>8}{r.items_per_s:>9.2f}"
                       f"{r.restarts:>10}  {hits}")
        return out
