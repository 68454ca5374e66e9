"""Consistent hashing with bounded loads: which encoder replica encodes a media unit.

Each replica owns ``vnodes`` points on a 64-bit ring; a content key goes to the first point
clockwise from its hash. The same media therefore reaches the same encoder (its encoder cache hits)
and adding or removing a replica moves only the keys of the points it gains or loses. A hot key
must not overload its owner, so a replica already holding ``ceil((1 + epsilon) x (in flight + 1) /
replicas)`` units is passed over for the next one clockwise (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads"): no replica ever exceeds that bound, and the walk is
deterministic so a passed-over key still lands on the same second choice.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from typing import Iterable, Mapping


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class BoundedLoadRing:
    def __init__(self, replicas: Iterable[str], vnodes: int = 64, epsilon: float = 0.25) -> None:
        if vnodes < 1 or epsilon <= 0:
            raise ValueError(f"need vnodes >= 1 and epsilon > 0, got {vnodes}, {epsilon}")
        self.replicas = sorted(set(replicas))
        if not self.replicas:
            raise ValueError("a ring needs at least one replica")
        self.epsilon = epsilon
        ring = sorted((_point(f"{r}#{v}"), r) for r in self.replicas for v in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def capacity(self, in_flight: int) -> int:
        """Units one replica may hold when ``in_flight`` are held in all (before adding one)."""
        return math.ceil((1 + self.epsilon) * (in_flight + 1) / len(self.replicas))

    def owner(self, key: str) -> str:
        """The replica the key hashes to, ignoring load."""
        i = bisect.bisect(self._points, _point(key)) % len(self._points)
        return self._owners[i]

    def choose(self, key: str, loads: Mapping[str, int]) -> str:
        """The first replica clockwise from ``key`` under the load bound (``loads``: units in flight
        per replica; missing ones count 0)."""
        cap = self.capacity(sum(loads.get(r, 0) for r in self.replicas))
        start = bisect.bisect(self._points, _point(key))
        n = len(self._points)
        for step in range(n):
            r = self._owners[(start + step) % n]
            if loads.get(r, 0) < cap:
                return r
        raise AssertionError("unreachable: the bound leaves room on some replica")
