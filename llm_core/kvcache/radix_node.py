"""The radix-tree node of the SWA-aware prefix cache, per-token keys, and the window arithmetic that
the tree, the naive reference and the tiers all share (one definition, so they cannot disagree).

A node is an edge of whole pages. Each page has a key (its tokens' keys), a Full page and an SWA page
(-1 when the tree holds no SWA KV for it):

    path from the root:  [root] --(pages 0..2)--> [A] --(pages 3..4)--> [B]
    A.start = 0, A.end = 3, B.start = 3, B.end = 5      (positions in pages along the path)
    A.full = [17, 3, 42]      A.swa = [-1, -1, 9]       page 2 of A still has SWA KV
    B.full = [8, 11]          B.swa = [-1, 5]
    a node whose swa is all -1 is a *tombstone*: its Full KV still serves full-attention layers.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Sequence

PageKey = tuple  # page_size per-token keys: an int token id, or (token id, media key) inside media
ExtraKey = tuple[int, int, bytes]  # (start, end, content key) over token positions [start, end)

_ids = itertools.count(1)


class RadixNode:
    """One edge of the tree. Invariants (checked by ``SWARadixCache.check_integrity``):

    - ``len(keys) == len(full) == len(swa) >= 1`` except at the root (all empty)
    - ``children[k].keys[0] == k`` and ``children[k].start == self.end``
    - ``full_lock >= swa_lock >= 0``; a node with ``full_lock > 0`` lies on a running request's path
    - with SWA layers, a leaf holds at least one valid SWA page (a leaf is never a tombstone)
    """

    __slots__ = ("nid", "parent", "children", "keys", "full", "swa", "start", "full_lock", "swa_lock",
                 "last_access", "alive", "hashes")

    def __init__(self, parent: "RadixNode | None", start: int, keys: list[PageKey], full: list[int],
                 swa: list[int], hashes: list[bytes] | None = None) -> None:
        self.nid = next(_ids)
        self.parent = parent
        self.children: dict[PageKey, RadixNode] = {}
        self.keys = keys
        self.full = full
        self.swa = swa
        self.start = start
        self.full_lock = 0
        self.swa_lock = 0
        self.last_access = 0
        self.alive = True
        self.hashes = hashes  # content hash chain per page (tiers only), else None

    @property
    def end(self) -> int:
        return self.start + len(self.keys)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_tombstone(self) -> bool:
        return all(s < 0 for s in self.swa)

    @property
    def num_swa(self) -> int:
        return sum(1 for s in self.swa if s >= 0)

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


# ---- LRU order ----------------------------------------------------------------------------------
class LruHeap:
    """Min-heap of nodes by last access, lazily invalidated (one per eviction order: Full and SWA).

    Touching a node pushes a fresh ``(last_access, nid)`` entry; older entries go stale and are skipped
    when popped. An entry is also dropped when its node is not eligible at pop time; whoever makes a
    node eligible again (unlock, becoming a leaf, SWA revival) pushes it anew, so every eligible node
    always has a live entry (``SWARadixCache.check_integrity`` verifies exactly that).
    """

    def __init__(self, eligible: Callable[[RadixNode], bool]) -> None:
        self.eligible = eligible
        self._heap: list[tuple[int, int, RadixNode]] = []

    def push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.nid, node))

    def pop(self) -> RadixNode | None:
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


# ---- keys -----------------------------------------------------------------------------------------
def check_extra_keys(extra_keys: Sequence[ExtraKey], num_tokens: int) -> None:
    """Raise ValueError unless the ranges are well formed, sorted and non-overlapping."""
    prev_end = 0
    for item in extra_keys:
        if len(item) != 3:
            raise ValueError(f"extra key must be (start, end, bytes), got {item!r:.80}")
        start, end, key = item
        if not isinstance(key, (bytes, bytearray)) or not key:
            raise ValueError(f"extra key over [{start}, {end}) must be non-empty bytes, got {type(key).__name__}")
        if not (prev_end <= start < end <= num_tokens):
            raise ValueError(f"extra key range [{start}, {end}) must be sorted, non-overlapping and inside "
                             f"the {num_tokens}-token prompt")
        prev_end = end


def token_keys(token_ids: Sequence[int], extra_keys: Sequence[ExtraKey], start: int, end: int) -> list:
    """Keys of positions [start, end): the token id, or (id, content key) inside an extra-key range.

    Equal ids with different media therefore never compare equal.
    """
    keys: list = list(token_ids[start:end])
    for lo, hi, key in extra_keys:
        for pos in range(max(lo, start), min(hi, end)):
            keys[pos - start] = (keys[pos - start], bytes(key))
    return keys


def page_keys(token_ids: Sequence[int], extra_keys: Sequence[ExtraKey], page_size: int,
              first_page: int, end_page: int) -> list[PageKey]:
    """Keys of whole pages [first_page, end_page) (the caller guarantees those pages are complete)."""
    keys = token_keys(token_ids, extra_keys, first_page * page_size, end_page * page_size)
    return [tuple(keys[i:i + page_size]) for i in range(0, len(keys), page_size)]


# ---- window arithmetic --------------------------------------------------------------------------
def window_first_page(num_pages: int, window: int | None, page_size: int) -> int:
    """First page whose SWA KV must be present to resume computing at token ``P = num_pages*page_size``.

    The query at P sees keys P-W+1 .. P; keys before P come from the cache:

        W = 4, page_size 2, P = 8:  needs keys 5, 6, 7
        pages   [0 1][2 3][4 5][6 7] | 8
                            ^^^ page 2 = (8 - 4 + 1) // 2

    The last page (num_pages - 1) is always included, even when W - 1 keys fit in less than a page or
    W == 1, so the tail of a match always has SWA KV (which keeps the "leaf is never a tombstone"
    invariant reachable when page_size > window). Without sliding layers nothing is needed.
    """
    if window is None or num_pages == 0:
        return num_pages
    return min(max(0, num_pages * page_size - window + 1) // page_size, num_pages - 1)


def window_safe_pages(swa_valid: Sequence[bool], limit: int, window: int | None, page_size: int) -> int:
    """Largest p <= limit such that pages [window_first_page(p), p) all have valid SWA (0 if none)."""
    if window is None:
        return limit
    last_invalid = -1  # last page index < p whose SWA is missing
    best = 0
    for p in range(1, limit + 1):
        if not swa_valid[p - 1]:
            last_invalid = p - 1
        if last_invalid < window_first_page(p, window, page_size):
            best = p
    return best


def keeps_swa(page: int, prompt_tokens: int, every: int, window: int | None, page_size: int) -> bool:
    """Does the tree keep page ``page``'s SWA KV once its request has moved past it?

    Yes for checkpoint windows and for the window that ends at the prompt's last whole page, so the
    same prompt sent again (other sampling, a retry) hits up to its last page.
    """
    prompt_pages = (prompt_tokens - 1) // page_size
    if window_first_page(prompt_pages, window, page_size) <= page < prompt_pages:
        return True
    return is_checkpoint_page(page, every, window, page_size)


def is_checkpoint_page(page: int, every: int, window: int | None, page_size: int) -> bool:
    """True when ``page`` lies in the window kept for a checkpoint (positions every K tokens).

    The checkpoint that can need page j is the first multiple C of K at or after j's end:

        K = 8, page_size 2, W = 4:  C = 8 keeps pages window_first_page(4) .. 3 = 2, 3
        pages [0 1][2 3][4 5][6 7] | [8 9] ...
                          ^^^^^^^^ kept
    """
    if every <= 0 or window is None:
        return False
    c = -(-((page + 1) * page_size) // every) * every
    return window_first_page(c // page_size, window, page_size) <= page


# ---- integrity ----------------------------------------------------------------------------------------
def check_tree_integrity(cache, requests=None) -> None:
    """Every invariant of an ``SWARadixCache`` (duck-typed to keep this module free of the cache).

    Structure, locks recomputed from the holders, leaf never tombstone, unique page ownership, page
    reference counts, and an LRU entry for every node eligible for eviction.
    """
    pool, root = cache.pool, cache.root
    seen: dict[int, RadixNode] = {}
    full_refs: dict[int, int] = {}
    swa_refs: dict[int, int] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.alive and child.parent is node, f"{child} is dead or has the wrong parent"
            assert child.keys and child.keys[0] == key, f"{child} filed under the wrong key"
            assert child.start == node.end, f"{child} does not start where its parent ends"
            assert len(child.keys) == len(child.full) == len(child.swa), f"{child}: table lengths differ"
            if child.hashes is not None:
                assert len(child.hashes) == len(child.keys), f"{child}: hash chain length differs"
            assert child.full_lock >= child.swa_lock >= 0, f"{child}: locks out of order"
            if cache.has_swa:
                assert not (child.is_leaf and child.is_tombstone), f"leaf {child} is a tombstone"
            else:
                assert child.is_tombstone, f"{child} holds SWA pages in a layout without sliding layers"
            for f in child.full:
                assert f >= 0 and f not in full_refs, f"Full page {f} listed twice in the tree"
                full_refs[f] = 1
            for s in child.swa:
                if s >= 0:
                    assert s not in swa_refs, f"SWA page {s} listed twice in the tree"
                    swa_refs[s] = 1
            assert child.nid not in seen
            seen[child.nid] = child
            stack.append(child)
    assert set(seen) == set(cache._nodes), "node registry and tree disagree"
    expect: dict[int, list[int]] = {nid: [0, 0] for nid in seen}
    for tail, swa_lo in cache.holder_paths():
        assert tail is root or tail.alive, f"a request holds the deleted node {tail}"
        node = tail
        while node is not root:
            expect[node.nid][0] += 1
            expect[node.nid][1] += node.end > swa_lo
            node = node.parent
    for nid, (full_lock, swa_lock) in expect.items():
        node = seen[nid]
        assert (node.full_lock, node.swa_lock) == (full_lock, swa_lock), \
            f"{node}: locks {node.full_lock}/{node.swa_lock}, holders account for {full_lock}/{swa_lock}"
    full_entries, swa_entries = cache.lru_entries()
    for node in seen.values():
        stamp = (node.last_access, node.nid)
        if cache._full_lru.eligible(node):
            assert stamp in full_entries, f"{node} is evictable but missing from the Full LRU"
        if cache._swa_lru.eligible(node):
            assert stamp in swa_entries, f"{node} is SWA-evictable but missing from the SWA LRU"
    for p in list(full_refs):
        assert pool.full.refcount(p) >= 1, f"tree lists free Full page {p}"
    for s in list(swa_refs):
        assert pool.swa.refcount(s) >= 1, f"tree lists free SWA page {s}"
    pool.check_integrity()
    if requests is None:
        return
    for r in requests:
        for f in r.full_pages:
            full_refs[f] = full_refs.get(f, 0) + 1
        for s in r.swa_pages:
            if s >= 0:
                swa_refs[s] = swa_refs.get(s, 0) + 1
    for name, alloc, refs in (("Full", pool.full, full_refs), ("SWA", pool.swa, swa_refs)):
        for page in range(alloc.num_pages):
            want = refs.get(page, 0)
            assert alloc.refcount(page) == want, \
                f"{name} page {page}: refcount {alloc.refcount(page)}, owners account for {want}"
