"""One node of the SWA-aware radix tree: an edge of whole pages (docs/kv_cache.md §3).

Each page of a node has a key (its tokens' keys), a Full page and an SWA page (-1 when the tree holds
no SWA KV for it):

    path from the root:  [root] --(pages 0..2)--> [A] --(pages 3..4)--> [B]
    A.start = 0, A.end = 3, B.start = 3, B.end = 5      (positions in pages along the path)
    A.full = [17, 3, 42]      A.swa = [-1, -1, 9]       page 2 of A still has SWA KV
    B.full = [8, 11]          B.swa = [-1, 5]
    a node whose swa is all -1 is a *tombstone*: its Full KV still serves full-attention layers.

A node is a record. Each group of fields has one writer: the tree (structure and page tables,
``radix_tree.py``), the lock table (the two locks, ``lock_table.py``) and the eviction policy
(``last_access``, ``eviction_policy.py``); the radix cache wires them together.
"""

from __future__ import annotations

import itertools

from llm_core.kvcache.page_keys import PageKey
from llm_core.kvcache.swa_window import window_first_page

_ids = itertools.count(1)


class RadixNode:
    """One edge of the tree. Invariants (checked by ``SWARadixCache.check_integrity``) sit next to the
    fields below."""

    __slots__ = ("nid", "parent", "children", "keys", "full", "swa", "swa_held", "start", "full_lock", "swa_lock",
                 "last_access", "alive", "hashes")

    def __init__(self, parent: "RadixNode | None", start: int, keys: list[PageKey], full: list[int],
                 swa: list[int], hashes: list[bytes] | None = None) -> None:
        self.nid = next(_ids)
        self.parent = parent
        # children[k].keys[0] == k and children[k].start == self.end
        self.children: dict[PageKey, RadixNode] = {}
        # len(keys) == len(full) == len(swa) >= 1 except at the root (all empty). Every Full page >= 0
        # and listed by one node only; SWA pages likewise, -1 where the tree holds none.
        # With sliding layers a leaf holds at least one SWA page (a leaf is never a tombstone);
        # without them no node holds any.
        self.keys = keys
        self.full = full
        self.swa = swa
        # the SWA pages held (entries >= 0): written with ``swa`` (RadixTree.set_swa, split), so a node's
        # and the tree's counts are O(1) to read (the stats snapshot after every request read them)
        self.swa_held = sum(1 for s in swa if s >= 0)
        self.start = start  # path position (in pages) of keys[0]
        # full_lock >= swa_lock >= 0, each the number of requests holding the node that way
        # (lock_table.py); full_lock > 0 means the node lies on a running request's path
        self.full_lock = 0
        self.swa_lock = 0
        self.last_access = 0  # eviction clock stamp; a parent is never older than its children
        self.alive = True  # False once removed from the tree (stale LRU entries skip it)
        self.hashes = hashes  # content hash chain per page (tiers only), same length as keys, else None

    @property
    def end(self) -> int:
        return self.start + len(self.keys)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_tombstone(self) -> bool:
        return self.swa_held == 0

    @property
    def num_swa(self) -> int:
        return self.swa_held

    def last_window_index(self, window: int | None, page_size: int) -> int:
        """Index in this node of the first page of the window that ends at this node's end (may be
        negative: the window starts in an ancestor)."""
        return window_first_page(self.end, window, page_size) - self.start

    def split(self, k: int) -> "RadixNode":
        """Cut this node after its first ``k`` pages; returns the new *upper* node.

        The upper part is the new object so that anyone holding this node (a request's tail) keeps
        pointing at the part it owns:

            parent -> [self: k0 k1 k2 k3]   split(2)   parent -> [head: k0 k1] -> [self: k2 k3]

        Locks are copied: every request locking ``self`` also passes through (and locks) ``head``.
        """
        if not 0 < k < len(self.keys):
            raise ValueError(f"split point {k} outside (0, {len(self.keys)})")
        assert self.parent is not None
        head = RadixNode(self.parent, self.start, self.keys[:k], self.full[:k], self.swa[:k],
                         self.hashes[:k] if self.hashes is not None else None)
        head.full_lock, head.swa_lock, head.last_access = self.full_lock, self.swa_lock, self.last_access
        self.parent.children[self.keys[0]] = head
        head.children[self.keys[k]] = self
        self.parent = head
        self.keys, self.full, self.swa = self.keys[k:], self.full[k:], self.swa[k:]
        self.swa_held -= head.swa_held
        if self.hashes is not None:
            self.hashes = self.hashes[k:]
        self.start += k
        return head

    def locate(self, page: int) -> tuple["RadixNode", int]:
        """(node, index in node) of absolute path page ``page`` on the path ending at this node."""
        node: RadixNode | None = self
        while node is not None and node.start > page:
            node = node.parent
        if node is None or not node.start <= page < node.end:
            raise IndexError(f"page {page} is not on this path (ends at page {self.end})")
        return node, page - node.start

    def __repr__(self) -> str:
        return (f"RadixNode(#{self.nid}, pages [{self.start}, {self.end}), full={self.full}, swa={self.swa}, "
                f"locks={self.full_lock}/{self.swa_lock})")
