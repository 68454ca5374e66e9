"""LRU orders and eviction of the SWA radix cache (``SWARadixCache``'s eviction half).

Two LRU orders over the tree's nodes, each a lazy heap (stale entries are skipped on pop):

    Full LRU: unlocked leaves            -> delete the leaf (Full + SWA pages), then the pages of an
                                            unlocked parent left as a leaf past its last window-safe
                                            match point (a leaf is never a tombstone)
    SWA  LRU: SWA-unlocked nodes with    -> internal node: tombstone it (drop all its SWA, keep Full);
              SWA pages they may drop       leaf: drop SWA before its last window (it keeps its match
                                            point)

Freeing drops the tree's reference through the pool allocators (a page a request still references
stays allocated); tombstoning and deleting first save the node's pages to the tiers (L2/L3), if any.
"""

from __future__ import annotations

from collections import Counter

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.radix_node import LruHeap, RadixNode, window_first_page, window_safe_pages


class RadixEviction:
    """The eviction and recency bookkeeping of an ``SWARadixCache`` (a base of it).

    It reads the cache's tree state (``root``, ``_nodes``, ``pool``, ``tiers``) and owns the clock and
    the two LRU heaps (``_init_eviction``)."""

    root: RadixNode
    pool: DualKVPool
    page_size: int
    window: int | None
    has_swa: bool
    tiers: object | None
    counters: Counter[str]
    _nodes: dict[int, RadixNode]

    def _init_eviction(self) -> None:
        self._clock = 0
        self._full_lru = LruHeap(lambda n: n.is_leaf and n.full_lock == 0)
        self._swa_lru = LruHeap(self._swa_evictable)

    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """Free at least the given tokens of Full and SWA KV if unlocked cache holds that much.

        Full: delete LRU unlocked leaves (with their SWA). SWA: first, in LRU order, tombstone internal
        nodes and drop leaves' SWA pages before their last window (Full KV stays; every leaf keeps its
        match point), then delete LRU leaves. An unlocked parent left as a leaf loses its pages past its
        last window-safe match point (all of them if it is a tombstone).
        Returns the tokens freed (Full, SWA)."""
        ps = self.page_size
        need_full, need_swa = -(-full_tokens // ps), -(-swa_tokens // ps)
        freed_full = freed_swa = 0
        while freed_full < need_full and (node := self._full_lru.pop()) is not None:
            f, s = self._delete_leaf(node)
            freed_full, freed_swa = freed_full + f, freed_swa + s
        while freed_swa < need_swa and (node := self._swa_lru.pop()) is not None:
            freed_swa += self._tombstone(node, 0 if node.children else self._leaf_window(node))
        while freed_swa < need_swa and (node := self._full_lru.pop()) is not None:
            f, s = self._delete_leaf(node)
            freed_full, freed_swa = freed_full + f, freed_swa + s
        self._compact_lru()
        return freed_full * ps, freed_swa * ps

    def lru_entries(self) -> tuple[set, set]:
        return self._full_lru.live_entries(), self._swa_lru.live_entries()

    # ---- tree surgery and LRU ---------------------------------------------------------------------
    def _split(self, node: RadixNode, k: int) -> RadixNode:
        head = node.split(k)
        self._nodes[head.nid] = head
        self._push(head)
        return head

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        node.last_access = self._clock
        self._push(node)

    def _touch_path(self, tail: RadixNode) -> None:
        """Ancestors are touched after descendants' stamps: a parent is never older than a child."""
        node = tail
        self._clock += 1
        while node is not self.root:
            node.last_access = self._clock
            self._push(node)
            node = node.parent

    def _push(self, node: RadixNode) -> None:
        if node is not self.root and node.alive:
            self._full_lru.push(node)
            self._swa_lru.push(node)

    def _compact_lru(self) -> None:
        if len(self._full_lru) + len(self._swa_lru) > 8 * len(self._nodes) + 512:
            self._full_lru.rebuild(self._nodes.values())
            self._swa_lru.rebuild(self._nodes.values())

    # ---- freeing pages ------------------------------------------------------------------------------
    def _free_swa_page(self, node: RadixNode, i: int) -> int:
        """Drop the tree's reference on one SWA page; 1 when that returned it to the free list."""
        s = node.swa[i]
        freed = 1 if self.pool.swa.refcount(s) == 1 else 0
        self.pool.swa.free([s])
        node.swa[i] = -1
        return freed

    def _leaf_window(self, node: RadixNode) -> int:
        """Index in ``node`` of the first page of its last window (pages from there on stay)."""
        return window_first_page(node.end, self.window, self.page_size) - node.start

    def _live_pages(self, leaf: RadixNode) -> int:
        """How many of ``leaf``'s pages end at or before its path's last window-safe match point."""
        path = []
        node = leaf
        while node is not self.root:
            path.append(node)
            node = node.parent
        valid = [s >= 0 for n in reversed(path) for s in n.swa]
        return max(0, window_safe_pages(valid, len(valid), self.window, self.page_size) - leaf.start)

    def _swa_evictable(self, node: RadixNode) -> bool:
        """An internal node with SWA, or a leaf with SWA before its last window; never SWA-locked."""
        if node.swa_lock or not node.num_swa:
            return False
        return bool(node.children) or any(s >= 0 for s in node.swa[:max(0, self._leaf_window(node))])

    def _tombstone(self, node: RadixNode, keep_from: int = 0) -> int:
        """Free the node's SWA pages before index ``keep_from`` (0 for an internal node: all of them;
        a leaf keeps its last window). Full KV stays. Returns SWA pages freed."""
        if self.tiers is not None:
            self.tiers.save(self, node)
        upto = len(node.swa) if keep_from <= 0 else keep_from
        freed = sum(self._free_swa_page(node, i) for i in range(upto) if node.swa[i] >= 0)
        self.counters["evicted_swa_pages"] += freed
        self.counters["tombstoned_nodes" if keep_from <= 0 else "trimmed_leaves"] += 1
        return freed

    def _delete_leaf(self, node: RadixNode) -> tuple[int, int]:
        """Delete an unlocked leaf, then the dead tail of an unlocked parent left as a leaf (see
        ``_live_pages``; a leaf is never a tombstone). Returns (Full, SWA) pages freed."""
        freed_full = freed_swa = 0
        while True:
            if self.tiers is not None:
                self.tiers.save(self, node)
            freed_full += sum(1 for f in node.full if self.pool.full.refcount(f) == 1)
            self.pool.full.free(node.full)
            freed_swa += sum(self._free_swa_page(node, i) for i, s in enumerate(node.swa) if s >= 0)
            parent = node.parent
            assert parent is not None
            del parent.children[node.keys[0]]
            del self._nodes[node.nid]
            node.alive = False
            self.counters["deleted_nodes"] += 1
            if parent is self.root or parent.children:
                break
            if self.has_swa and parent.full_lock == 0:
                # Newly a leaf: pages past its last window-safe match point can never be handed out
                # again (an internal node may have dropped their SWA while a child still needed
                # them). Cut them off and delete them too -- all of it if nothing is left, which
                # covers a tombstone parent; else a later split could leave a tombstone leaf.
                live = self._live_pages(parent)
                if live < len(parent.keys):
                    if live > 0:
                        self._split(parent, live)  # ``parent`` keeps the dead lower part
                    node = parent
                    continue
            self._push(parent)  # newly a leaf: a Full eviction candidate
            break
        self.counters["evicted_full_pages"] += freed_full
        self.counters["evicted_swa_pages"] += freed_swa
        return freed_full, freed_swa
