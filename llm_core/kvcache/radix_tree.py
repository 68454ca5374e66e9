"""The node store of the SWA radix cache: the root, a registry of live nodes, walks and structural
edits (docs/kv_cache.md §3). It lists pages but never references or frees them (the cache and its
eviction policy do, through the pool allocators), and it knows nothing of locks or LRU order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from llm_core.kvcache.page_keys import PageKey
from llm_core.kvcache.radix_node import RadixNode


@dataclass(frozen=True)
class TreeMatch:
    """The longest Full match of a page-key list: the nodes along it with the pages matched in each
    (the last one may be matched only partly), and per matched page whether its SWA KV is cached."""

    nodes: list[tuple[RadixNode, int]]
    swa_valid: list[bool]

    @property
    def pages(self) -> int:
        return len(self.swa_valid)


class RadixTree:
    """Invariants (``check_integrity``): the registry holds exactly the nodes reachable from the root,
    every node satisfies the structural invariants written in ``RadixNode``, no page is listed twice,
    and the counters below equal what a walk of the nodes counts.

    The counters (Full pages, SWA pages and tombstones listed) are kept by the edits, which are the
    only writers of the page tables, so reading them is O(1): the engine's stats snapshot after every
    request read them, and a walk of a production-sized tree (10^5 nodes) there would stall the engine
    thread for tens of milliseconds each time."""

    def __init__(self) -> None:
        self.root = RadixNode(None, 0, [], [], [])
        self.root.full_lock = 1  # never evicted, never a leaf candidate
        self._nodes: dict[int, RadixNode] = {}  # nid -> node, every node but the root
        # splits so far: the only edit that changes a locked path between its root and its tail
        # (what SWARadixCache._advance_window's no-op check relies on)
        self.splits = 0
        self.full_pages = 0
        self.swa_pages = 0
        self.tombstones = 0

    # ---- queries ----------------------------------------------------------------------------------
    def walk(self, keys: list[PageKey]) -> TreeMatch:
        """Follow ``keys`` from the root as far as the tree has them (no changes)."""
        node, j, nodes, valid = self.root, 0, [], []
        while j < len(keys):
            child = node.children.get(keys[j])
            if child is None:
                break
            n = 1
            while n < len(child.keys) and j + n < len(keys) and child.keys[n] == keys[j + n]:
                n += 1
            nodes.append((child, n))
            valid.extend(s >= 0 for s in child.swa[:n])
            j += n
            if n < len(child.keys):
                break
            node = child
        return TreeMatch(nodes, valid)

    def nodes(self) -> list[RadixNode]:
        """Every node but the root (a snapshot)."""
        return list(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def path(self, tail: RadixNode) -> Iterator[RadixNode]:
        """The nodes from ``tail`` up to (not including) the root."""
        node = tail
        while node is not self.root:
            yield node
            node = node.parent

    def path_swa_valid(self, tail: RadixNode) -> list[bool]:
        """Per page of the path ending at ``tail`` (from the root): is its SWA KV cached?"""
        return [s >= 0 for n in reversed(list(self.path(tail))) for s in n.swa]

    # ---- edits ------------------------------------------------------------------------------------
    def split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after ``k`` pages (see ``RadixNode.split``); returns the new upper node."""
        was_tombstone = node.is_tombstone
        head = node.split(k)
        self.tombstones += head.is_tombstone + node.is_tombstone - was_tombstone
        self._nodes[head.nid] = head
        self.splits += 1
        return head

    def add(self, parent: RadixNode, keys: list[PageKey], full: list[int], swa: list[int],
            hashes: list[bytes] | None) -> RadixNode:
        """A new child of ``parent`` holding the given pages (the caller has referenced them)."""
        node = RadixNode(parent, parent.end, list(keys), list(full), list(swa), hashes)
        parent.children[node.keys[0]] = node
        self._nodes[node.nid] = node
        self._count(node, 1)
        return node

    def set_full(self, node: RadixNode, i: int, page: int) -> None:
        """Set ``node``'s i-th Full page to another copy of the same KV (the caller moves the references)."""
        assert page >= 0, f"a node's Full page must be mapped, got {page}"
        node.full[i] = page

    def set_swa(self, node: RadixNode, i: int, page: int) -> None:
        """Set ``node``'s i-th SWA page (-1: the tree holds none for it; the caller moves the reference)."""
        was_tombstone = node.is_tombstone
        held = (page >= 0) - (node.swa[i] >= 0)
        node.swa[i] = page
        node.swa_held += held
        self.swa_pages += held
        self.tombstones += node.is_tombstone - was_tombstone

    def remove_leaf(self, node: RadixNode) -> None:
        """Unlink a leaf (the caller has dropped its page references)."""
        assert node.is_leaf and node.parent is not None, f"{node} is not a removable leaf"
        del node.parent.children[node.keys[0]]
        del self._nodes[node.nid]
        self._count(node, -1)
        node.alive = False

    def _count(self, node: RadixNode, sign: int) -> None:
        self.full_pages += sign * len(node.full)
        self.swa_pages += sign * node.swa_held
        self.tombstones += sign * node.is_tombstone

    # ---- integrity --------------------------------------------------------------------------------
    def check_integrity(self, has_swa: bool) -> tuple[set[int], set[int]]:
        """Raise AssertionError unless the structure holds; returns the (Full, SWA) pages listed."""
        seen: set[int] = set()
        full_pages: set[int] = set()
        swa_pages: set[int] = set()
        tombstones = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.alive and child.parent is node, f"{child} is dead or has the wrong parent"
                assert child.keys and child.keys[0] == key, f"{child} filed under the wrong key"
                assert child.start == node.end, f"{child} does not start where its parent ends"
                assert len(child.keys) == len(child.full) == len(child.swa), f"{child}: table lengths differ"
                if child.hashes is not None:
                    assert len(child.hashes) == len(child.keys), f"{child}: hash chain length differs"
                assert child.swa_held == sum(1 for s in child.swa if s >= 0), f"{child}: SWA count is stale"
                tombstones += child.is_tombstone
                if has_swa:
                    assert not (child.is_leaf and child.is_tombstone), f"leaf {child} is a tombstone"
                else:
                    assert child.is_tombstone, f"{child} holds SWA pages in a layout without sliding layers"
                for f in child.full:
                    assert f >= 0 and f not in full_pages, f"Full page {f} listed twice in the tree"
                    full_pages.add(f)
                for s in child.swa:
                    if s >= 0:
                        assert s not in swa_pages, f"SWA page {s} listed twice in the tree"
                        swa_pages.add(s)
                assert child.nid not in seen
                seen.add(child.nid)
                stack.append(child)
        assert seen == set(self._nodes), "node registry and tree disagree"
        assert (self.full_pages, self.swa_pages, self.tombstones) == (len(full_pages), len(swa_pages), tombstones), \
            f"counters (Full, SWA, tombstones) {(self.full_pages, self.swa_pages, self.tombstones)} differ from " \
            f"the walk's {(len(full_pages), len(swa_pages), tombstones)}"
        return full_pages, swa_pages
