"""Per-request lock bookkeeping of the SWA radix cache (``SWARadixCache``'s lock half).

A request holds the tree through a :class:`_Holder`: Full locks on its whole path, SWA locks on the
path nodes that end after the first page of its last window (its tail always included), so
``full_lock >= swa_lock`` on every node:

    W = 4, page_size 2, tail ends at page 7 (P = 14): last window from page (14 - 4 + 1) // 2 = 5
    path       [ n1 ][    n2     ][n3]
    pages       0  1  2  3  4  5  6
    full_lock   +1    +1          +1      every node on the path
    swa_lock          +1          +1      nodes with end > 5;  swa_lo = n2.start = 2

As the request computes, the window moves right: nodes that end at or before the new window's first
page lose their SWA lock, and the SWA pages this request gave the tree behind the window are dropped
(unless a checkpoint, the prompt's last window, or another running request's window keeps them).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from llm_core.kvcache.radix_node import RadixNode, keeps_swa, window_first_page


@dataclass
class _Holder:
    """What the tree remembers about a request between match and release."""

    tail: RadixNode  # deepest node of the request's path (the root when nothing is on the tree)
    swa_lo: int  # path nodes with end > swa_lo carry one SWA lock of this request
    prompt_tokens: int  # the window ending at the prompt's last whole page keeps its SWA
    own_swa: deque = field(default_factory=deque)  # (path page, SWA page) the request gave the tree


class RadixLocks:
    """Lock, unlock and window-advance steps over the holders of an ``SWARadixCache``.

    A base of ``SWARadixCache``: it reads the cache's tree state (``root``, ``window``, ``_holders``)
    and calls its eviction helpers (``_push``, ``_free_swa_page``, ``_delete_leaf``)."""

    root: RadixNode
    window: int | None
    page_size: int
    checkpoint_every: int
    has_swa: bool
    counters: Counter[str]
    _holders: dict

    def _lock_path(self, holder: _Holder, swa_from: int) -> None:
        """Full-lock every node up to the tail; SWA-lock those ending after page ``swa_from``."""
        node = holder.tail
        holder.swa_lo = node.end
        while node is not self.root:
            node.full_lock += 1
            if node.end > swa_from:
                node.swa_lock += 1
                holder.swa_lo = node.start
            node = node.parent

    def _advance_window(self, holder: _Holder) -> None:
        """Move the SWA lock to the tail's last window; trim own SWA pages that fell behind it."""
        want = window_first_page(holder.tail.end, self.window, self.page_size)
        node, new_lo = holder.tail, holder.swa_lo
        while node is not self.root and node.end > holder.swa_lo:
            if node.end <= want:
                node.swa_lock -= 1
                if node.swa_lock == 0:
                    self._push(node)
            else:
                new_lo = node.start
            node = node.parent
        holder.swa_lo = new_lo
        behind = []
        while holder.own_swa and holder.own_swa[0][0] < want:
            behind.append(holder.own_swa.popleft())
        node = holder.tail
        for page, phys in reversed(behind):
            if keeps_swa(page, holder.prompt_tokens, self.checkpoint_every, self.window, self.page_size):
                continue
            while node.start > page:
                node = node.parent
            i = page - node.start
            if node.swa[i] == phys and not self._in_other_window(holder, node, page):
                self._free_swa_page(node, i)
                self.counters["trimmed_swa_pages"] += 1

    def _in_other_window(self, holder: _Holder, node: RadixNode, page: int) -> bool:
        """Is path page ``page`` (in ``node``) inside another running request's last window?

        Such a page may be that request's tail; trimming it could leave a tombstone leaf."""
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

    def _unlock(self, holder: _Holder) -> None:
        node = holder.tail
        while node is not self.root:
            node.full_lock -= 1
            if node.end > holder.swa_lo:
                node.swa_lock -= 1
            if node.full_lock == 0 or node.swa_lock == 0:
                self._push(node)
            node = node.parent
        tail = holder.tail  # a tombstone that became a leaf while locked goes now (leaf never tombstone)
        if tail is not self.root and tail.alive and tail.is_leaf and tail.full_lock == 0 and \
                self.has_swa and tail.is_tombstone:
            self._delete_leaf(tail)

    def holder_paths(self) -> list[tuple[RadixNode, int]]:
        """(tail, swa_lo) of every request holding the tree (for the integrity check)."""
        return [(h.tail, h.swa_lo) for h in self._holders.values()]
