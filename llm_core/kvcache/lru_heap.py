"""A lazily invalidated min-heap of radix nodes by last access: one LRU order of the eviction policy."""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

from llm_core.kvcache.radix_node import RadixNode


class LruHeap:
    """Min-heap of nodes by ``last_access``, lazily invalidated.

    Touching a node pushes a fresh ``(last_access, nid)`` entry; older entries go stale and are skipped
    when popped. An entry is also dropped when its node is not eligible at pop time; whoever makes a
    node eligible again (unlock, becoming a leaf, SWA revival) pushes it anew, so every eligible node
    always has a live entry (``EvictionPolicy.check_integrity`` verifies exactly that).
    """

    def __init__(self, eligible: Callable[[RadixNode], bool]) -> None:
        self.eligible = eligible
        self._heap: list[tuple[int, int, RadixNode]] = []

    def push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.nid, node))

    def pop(self) -> RadixNode | None:
        """The least recently used eligible node (its entry removed), or None."""
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node.alive and stamp == node.last_access and self.eligible(node):
                return node
        return None

    def rebuild(self, nodes: Iterable[RadixNode]) -> None:
        """Drop stale entries (called when the heap grows far beyond the node count)."""
        self._heap = [(n.last_access, n.nid, n) for n in nodes if self.eligible(n)]
        heapq.heapify(self._heap)

    def live_entries(self) -> set[tuple[int, int]]:
        return {(stamp, nid) for stamp, nid, node in self._heap if node.alive}

    def __len__(self) -> int:
        return len(self._heap)
