"""The eviction policy of the SWA radix cache: two LRU orders and what evicting means in each
(docs/kv_cache.md §6).

    Full LRU: unlocked leaves            -> delete the leaf (Full + SWA pages), then the pages of an
                                            unlocked parent left as a leaf past its last window-safe
                                            match point (a leaf is never a tombstone)
    SWA  LRU: SWA-unlocked nodes with    -> internal node: tombstone it (drop all its SWA, keep Full);
              SWA pages they may drop       leaf: drop SWA before its last window (it keeps its match
                                            point)

Freeing drops the tree's reference through the pool allocators (a page a request still references
stays allocated); tombstoning and deleting first save the node's pages to the tiers (L2/L3), if any.
A node also lets a page go when a running request computed the same KV again (``take_copy``).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.lru_heap import LruHeap
from llm_core.kvcache.radix_node import RadixNode
from llm_core.kvcache.radix_tree import RadixTree
from llm_core.kvcache.swa_window import window_first_page, window_safe_pages

if TYPE_CHECKING:
    from llm_core.kvcache.lock_table import LockTable
    from llm_core.kvcache.tiers.kv_tiers import KVTiers


class EvictionPolicy:
    """Recency (one clock, two lazy heaps) and eviction over one tree.

    Invariant (``check_integrity``): every node eligible for an order has a live entry in it."""

    def __init__(self, tree: RadixTree, pool: DualKVPool, tiers: KVTiers | None) -> None:
        self.tree = tree
        self.pool = pool
        self.tiers = tiers
        self.page_size = pool.page_size
        self.has_swa = pool.has_swa
        self.window = pool.layout.window if pool.has_swa else None
        self.counters: Counter[str] = Counter()  # deleted nodes, tombstoned nodes, trimmed leaves, pages freed
        self._clock = 0  # last stamp handed out; a node's last_access <= _clock
        self._full_lru = LruHeap(self._full_evictable)  # unlocked leaves
        self._swa_lru = LruHeap(self._swa_evictable)  # SWA-unlocked nodes with SWA they may drop

    # ---- recency ----------------------------------------------------------------------------------
    def touch(self, node: RadixNode) -> None:
        self._clock += 1
        node.last_access = self._clock
        self.push(node)

    def touch_path(self, tail: RadixNode) -> None:
        """Ancestors are touched after descendants' stamps: a parent is never older than a child."""
        self._clock += 1
        for node in self.tree.path(tail):
            node.last_access = self._clock
            self.push(node)

    def push(self, node: RadixNode) -> None:
        """(Re)enter ``node`` in both orders: call whenever it may have become eligible."""
        if node is not self.tree.root and node.alive:
            self._full_lru.push(node)
            self._swa_lru.push(node)

    # ---- eviction ---------------------------------------------------------------------------------
    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """Free at least the given tokens of Full and SWA KV if unlocked cache holds that much.

        Full: delete LRU unlocked leaves (with their SWA). SWA: first, in LRU order, tombstone internal
        nodes and drop leaves' SWA pages before their last window (Full KV stays; every leaf keeps its
        match point), then delete LRU leaves. Returns the tokens freed (Full, SWA)."""
        ps = self.page_size
        need_full, need_swa = -(-full_tokens // ps), -(-swa_tokens // ps)
        freed_full = freed_swa = 0
        while freed_full < need_full and (node := self._full_lru.pop()) is not None:
            f, s = self.delete_leaf(node)
            freed_full, freed_swa = freed_full + f, freed_swa + s
        while freed_swa < need_swa and (node := self._swa_lru.pop()) is not None:
            keep_from = 0 if node.children else node.last_window_index(self.window, ps)
            freed_swa += self._tombstone(node, keep_from)
        while freed_swa < need_swa and (node := self._full_lru.pop()) is not None:
            f, s = self.delete_leaf(node)
            freed_full, freed_swa = freed_full + f, freed_swa + s
        self._compact()
        return freed_full * ps, freed_swa * ps

    def free_swa_page(self, node: RadixNode, i: int) -> int:
        """Drop the tree's reference on ``node``'s i-th SWA page; 1 when that returned it to the free list."""
        s = node.swa[i]
        freed = 1 if self.pool.swa.refcount(s) == 1 else 0
        self.pool.swa.free([s])
        self.tree.set_swa(node, i, -1)
        return freed

    def take_copy(self, node: RadixNode, i: int, page: int, kind: str) -> bool:
        """Whether ``node``'s i-th page of ``kind`` ("full" / "sliding") is ``page`` -- a running
        request's copy of the same KV -- after this: the node takes it when nobody but the tree reads
        the node's own copy, which then returns to the pool (after any tier load still queued for it,
        which would land in its next owner). A prefix computed again is thus held once, and the
        request's lock on the node covers pages it reads (docs/kv_cache.md §3)."""
        pages, alloc = (node.full, self.pool.full) if kind == "full" else (node.swa, self.pool.swa)
        old = pages[i]
        if old == page:
            return True
        if alloc.refcount(old) != 1:
            return False
        if self.tiers is not None:
            self.tiers.threads.wait_loads()
        alloc.incref([page])
        alloc.free([old])
        (self.tree.set_full if kind == "full" else self.tree.set_swa)(node, i, page)
        return True

    def fold_copies(self, locks: LockTable, swa: bool = True) -> tuple[int, int, bool]:
        """Every page a running request reads its own copy of while the node lists another one: the
        node takes the request's copy once its own is the tree's alone (``take_copy``). Full: the
        pages ``Holder.copies`` lists. SWA (``swa``: when such a copy may exist): any page of the
        request's window, found by comparing (a window the node kept and another request read when
        this one computed it again; a tombstone another request revived with its own page): at most
        a window's pages a request. Returns the (Full, SWA) pages this freed and whether an SWA page
        is still held twice (its node's copy read by another request)."""
        before, left = (self.pool.full.num_free, self.pool.swa.num_free), False
        for request, holder in locks.held():
            if holder.copies:
                holder.copies = [p for p in holder.copies
                                 if not self.take_copy(*holder.tail.locate(p), request.full_pages[p], "full")]
            if swa and self.has_swa:
                want = window_first_page(holder.tail.end, self.window, self.page_size)
                node = holder.tail
                while node is not self.tree.root and node.end > want:
                    for i in range(max(want - node.start, 0), len(node.swa)):
                        mine = request.swa_pages[node.start + i]
                        if mine >= 0 and node.swa[i] >= 0 and not self.take_copy(node, i, mine, "sliding"):
                            left = True
                    node = node.parent
        return self.pool.full.num_free - before[0], self.pool.swa.num_free - before[1], left

    def delete_leaf(self, node: RadixNode) -> tuple[int, int]:
        """Delete an unlocked leaf, then the dead tail of an unlocked parent left as a leaf (see
        ``_live_pages``; a leaf is never a tombstone). Returns (Full, SWA) pages freed."""
        freed_full = freed_swa = 0
        while True:
            if self.tiers is not None:
                self.tiers.save(node)
            freed_full += sum(1 for f in node.full if self.pool.full.refcount(f) == 1)
            self.pool.full.free(node.full)
            freed_swa += sum(self.free_swa_page(node, i) for i, s in enumerate(node.swa) if s >= 0)
            parent = node.parent
            self.tree.remove_leaf(node)
            self.counters["deleted_nodes"] += 1
            if parent is self.tree.root or parent.children:
                break
            if self.has_swa and parent.full_lock == 0:
                # Newly a leaf: pages past its last window-safe match point can never be handed out
                # again (an internal node may have dropped their SWA while a child still needed
                # them). Cut them off and delete them too -- all of it if nothing is left, which
                # covers a tombstone parent; else a later split could leave a tombstone leaf.
                live = self._live_pages(parent)
                if live < len(parent.keys):
                    if live > 0:
                        self.push(self.tree.split(parent, live))  # ``parent`` keeps the dead lower part
                    node = parent
                    continue
            self.push(parent)  # newly a leaf: a Full eviction candidate
            break
        self.counters["evicted_full_pages"] += freed_full
        self.counters["evicted_swa_pages"] += freed_swa
        return freed_full, freed_swa

    # ---- integrity --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every eligible node has a live entry in its order."""
        full_entries, swa_entries = self._full_lru.live_entries(), self._swa_lru.live_entries()
        for node in self.tree.nodes():
            stamp = (node.last_access, node.nid)
            if self._full_evictable(node):
                assert stamp in full_entries, f"{node} is evictable but missing from the Full LRU"
            if self._swa_evictable(node):
                assert stamp in swa_entries, f"{node} is SWA-evictable but missing from the SWA LRU"

    # ---- internal helpers -------------------------------------------------------------------------
    @staticmethod
    def _full_evictable(node: RadixNode) -> bool:
        return node.is_leaf and node.full_lock == 0

    def _swa_evictable(self, node: RadixNode) -> bool:
        """An internal node with SWA, or a leaf with SWA before its last window; never SWA-locked."""
        if node.swa_lock or not node.num_swa:
            return False
        keep_from = max(0, node.last_window_index(self.window, self.page_size))
        return bool(node.children) or any(s >= 0 for s in node.swa[:keep_from])

    def _tombstone(self, node: RadixNode, keep_from: int = 0) -> int:
        """Free the node's SWA pages before index ``keep_from`` (0 for an internal node: all of them;
        a leaf keeps its last window). Full KV stays. Returns SWA pages freed."""
        if self.tiers is not None:
            self.tiers.save(node)
        upto = len(node.swa) if keep_from <= 0 else keep_from
        freed = sum(self.free_swa_page(node, i) for i in range(upto) if node.swa[i] >= 0)
        self.counters["evicted_swa_pages"] += freed
        self.counters["tombstoned_nodes" if keep_from <= 0 else "trimmed_leaves"] += 1
        return freed

    def _live_pages(self, leaf: RadixNode) -> int:
        """How many of ``leaf``'s pages end at or before its path's last window-safe match point."""
        valid = self.tree.path_swa_valid(leaf)
        return max(0, window_safe_pages(valid, len(valid), self.window, self.page_size) - leaf.start)

    def _compact(self) -> None:
        if len(self._full_lru) + len(self._swa_lru) > 8 * len(self.tree) + 512:
            nodes = self.tree.nodes()
            self._full_lru.rebuild(nodes)
            self._swa_lru.rebuild(nodes)
