"""Who holds which part of the radix tree: per-request Full and SWA locks (docs/kv_cache.md §5).

A request holds the tree through a :class:`Holder`: Full locks on its whole path, SWA locks on the
path nodes that end after the first page of its last window (its tail always included), so
``full_lock >= swa_lock`` on every node:

    W = 4, page_size 2, tail ends at page 7 (P = 14): last window from page (14 - 4 + 1) // 2 = 5
    path       [ n1 ][    n2     ][n3]
    pages       0  1  2  3  4  5  6
    full_lock   +1    +1          +1      every node on the path
    swa_lock          +1          +1      nodes with end > 5;  swa_lo = n2.start = 2

A Full lock keeps a node (its Full pages) in the tree; an SWA lock keeps its SWA pages too. As the
request computes, the window moves right and nodes that end at or before the new window's first page
lose their SWA lock. The table only counts: methods return the nodes that became unlocked, and the
cache hands them to the eviction policy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from llm_core.engine.request import Request
from llm_core.kvcache.radix_node import RadixNode
from llm_core.kvcache.swa_window import window_first_page


@dataclass
class Holder:
    """What the tree remembers about one request between match and release."""

    tail: RadixNode  # deepest node of the request's path (the root when nothing is on the tree)
    swa_lo: int  # path nodes with end > swa_lo carry one SWA lock of this request
    # page counts whose windows keep their SWA (swa_window.kept_window_ends): the prompt's last
    # whole page and the request's checkpoints
    kept_ends: tuple[int, ...]
    # (path page, SWA page) the request gave the tree, oldest first: the request drops these once
    # they fall behind its window (unless a checkpoint or another window keeps them)
    own_swa: deque[tuple[int, int]] = field(default_factory=deque)
    # path pages whose Full KV the request computed again and reads from its own page while the
    # node lists another copy, which another request read at insert (EvictionPolicy.take_copy)
    copies: list[int] = field(default_factory=list)
    # (tail, tail.end, swa_lo, tree splits) after the last window advance: while it holds, another
    # advance finds nothing to move (SWARadixCache._advance_window skips it)
    advanced: tuple | None = None

    def take_own_swa_before(self, page: int) -> list[tuple[int, int]]:
        """Remove and return the contributions on path pages < ``page`` (oldest first)."""
        out = []
        while self.own_swa and self.own_swa[0][0] < page:
            out.append(self.own_swa.popleft())
        return out


class LockTable:
    """The holders of one tree and the lock counts they put on its nodes.

    Invariant (``check_integrity``): every node's ``full_lock`` / ``swa_lock`` equals the number of
    holders whose path / SWA-locked part of the path passes through it."""

    def __init__(self, root: RadixNode, window: int | None, page_size: int) -> None:
        self.root = root
        self.window = window
        self.page_size = page_size
        self._holders: dict[Request, Holder] = {}  # request -> its holder

    # ---- holders ------------------------------------------------------------------------------
    def hold(self, request: Request, tail: RadixNode, kept_ends: tuple[int, ...], swa_from: int) -> Holder:
        """Register ``request`` as holding the path ending at ``tail`` (see ``lock_path``)."""
        holder = self._holders[request] = Holder(tail, 0, kept_ends)
        self.lock_path(holder, swa_from)
        return holder

    def get(self, request: Request) -> Holder | None:
        return self._holders.get(request)

    def pop(self, request: Request) -> Holder | None:
        """Forget ``request`` (its locks stay until ``unlock``)."""
        return self._holders.pop(request, None)

    def __contains__(self, request: Request) -> bool:
        return request in self._holders

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self) -> Iterator[Holder]:
        return iter(self._holders.values())

    def held(self) -> Iterator[tuple[Request, Holder]]:
        return iter(self._holders.items())

    # ---- locking ------------------------------------------------------------------------------
    def lock_path(self, holder: Holder, swa_from: int) -> None:
        """Full-lock every node up to the tail; SWA-lock those ending after page ``swa_from``."""
        node = holder.tail
        holder.swa_lo = node.end
        while node is not self.root:
            node.full_lock += 1
            if node.end > swa_from:
                node.swa_lock += 1
                holder.swa_lo = node.start
            node = node.parent

    def extend(self, holder: Holder, node: RadixNode) -> None:
        """The request's path grows by ``node`` (a child of its tail): lock it both ways."""
        node.full_lock += 1
        node.swa_lock += 1
        holder.tail = node

    def advance(self, holder: Holder) -> list[RadixNode]:
        """Move the SWA locks to the tail's last window; returns the nodes left SWA-unlocked."""
        want = window_first_page(holder.tail.end, self.window, self.page_size)
        node, new_lo, released = holder.tail, holder.swa_lo, []
        while node is not self.root and node.end > holder.swa_lo:
            if node.end <= want:
                node.swa_lock -= 1
                if node.swa_lock == 0:
                    released.append(node)
            else:
                new_lo = node.start
            node = node.parent
        holder.swa_lo = new_lo
        return released

    def unlock(self, holder: Holder) -> list[RadixNode]:
        """Drop every lock of ``holder``; returns the nodes left with a lock count of 0."""
        released = []
        node = holder.tail
        while node is not self.root:
            node.full_lock -= 1
            if node.end > holder.swa_lo:
                node.swa_lock -= 1
            if node.full_lock == 0 or node.swa_lock == 0:
                released.append(node)
            node = node.parent
        return released

    def in_other_window(self, holder: Holder, node: RadixNode, page: int) -> bool:
        """Is path page ``page`` (in ``node``) inside another running request's last window?

        Such a page may be that request's tail; dropping its SWA could leave a tombstone leaf."""
        if node.swa_lock <= (1 if node.end > holder.swa_lo else 0):
            return False  # nobody else SWA-locks the node, so no other window covers it
        for other in self._holders.values():
            if other is holder or page < window_first_page(other.tail.end, self.window, self.page_size):
                continue
            n = other.tail
            while n.start > node.start:
                n = n.parent
            if n is node:
                return True
        return False

    # ---- integrity ----------------------------------------------------------------------------
    def check_integrity(self, nodes: list[RadixNode]) -> None:
        """Raise AssertionError unless every lock count is exactly what the holders account for."""
        expect = {n.nid: [0, 0] for n in nodes}
        for holder in self._holders.values():
            assert holder.tail is self.root or holder.tail.alive, f"a request holds the deleted node {holder.tail}"
            node = holder.tail
            while node is not self.root:
                expect[node.nid][0] += 1
                expect[node.nid][1] += node.end > holder.swa_lo
                node = node.parent
        for node in nodes:
            assert node.full_lock >= node.swa_lock >= 0, f"{node}: locks out of order"
            full_lock, swa_lock = expect[node.nid]
            assert (node.full_lock, node.swa_lock) == (full_lock, swa_lock), \
                f"{node}: locks {node.full_lock}/{node.swa_lock}, holders account for {full_lock}/{swa_lock}"

    def check_reads(self) -> None:
        """Raise AssertionError unless every holder's request reads each Full page on its path, or
        lists the page as its own copy (``Holder.copies``), never both."""
        for request, holder in self.held():
            copies = set(holder.copies)
            node = holder.tail
            while node is not self.root:
                for i, page in enumerate(node.full):
                    pos = node.start + i
                    assert (request.full_pages[pos] == page) != (pos in copies), \
                        f"request {request.request_id} path page {pos}: reads {request.full_pages[pos]}, the " \
                        f"node lists {page}, {'listed' if pos in copies else 'not listed'} as its own copy"
                node = node.parent
