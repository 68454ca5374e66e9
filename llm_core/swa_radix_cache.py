"""SWA-aware radix prefix cache over the dual KV pool (the scheduler's ``PrefixCache``).

Tree pages share physical pages with requests through the allocators' reference counts: the tree holds
one reference per page it lists, every request one per page in its tables. A match therefore only
copies page ids (and takes references); nothing is ever copied between slots in L1.

Window-safe matching (fake hits under SWA are wrong outputs, not misses):

    W = 4, page_size 2                      tree path for the prompt (S = SWA kept, - = tombstoned)
    pages      0   1   2   3   4   5           Full:  0 1 2 3 4 5   all present
    SWA        -   -   S   -   S   S           to resume at P = 6 (p = 3 pages) keys 3..5 are needed
    resume at P = 12 (6 pages): needs pages 4, 5 -> valid -> match 12 tokens
    resume at P = 8  (4 pages): needs pages 2, 3 -> page 3 tombstoned -> not a candidate

Lifecycle: a request's computed pages are inserted after every step (before the scheduler releases the
request's out-of-window SWA pages, so the tree can keep what it wants); the tree then drops the SWA
pages this request contributed once they fall behind the request's last window, except checkpoint
windows (every ``checkpoint_every`` tokens) and the window ending at the prompt's last whole page. A
finished request thus leaves its Full KV, its last window of SWA KV, its prompt's and its checkpoints.

Locks: a request locks Full on its whole path and SWA on the path nodes ending after the first page of
its last window (always including its tail), so ``full_lock >= swa_lock`` on every node.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from llm_core.dual_pool import DualKVPool
from llm_core.radix_node import (LruHeap, RadixNode, check_tree_integrity, keeps_swa, page_keys,
                                 window_first_page, window_safe_pages)
from llm_core.request import Request
from llm_core.scheduler import PrefixCache


@dataclass
class _Holder:
    """What the tree remembers about a request between match and release."""

    tail: RadixNode  # deepest node of the request's path (the root when nothing is on the tree)
    swa_lo: int  # path nodes with end > swa_lo carry one SWA lock of this request
    prompt_tokens: int  # the window ending at the prompt's last whole page keeps its SWA
    own_swa: deque = field(default_factory=deque)  # (path page, SWA page) the request gave the tree


class SWARadixCache(PrefixCache):
    """Radix tree of page runs with Full pages, per-page SWA validity, two LRU orders and two locks."""

    def __init__(self, pool: DualKVPool, *, checkpoint_every: int = 0, tiers=None) -> None:
        """``checkpoint_every``: keep an SWA window every K tokens (0: off; a multiple of the page
        size). ``tiers``: an optional :class:`llm_core.kv_tiers.KVTiers` (L2 host memory + L3 store)."""
        ps = pool.page_size
        if checkpoint_every < 0 or checkpoint_every % ps:
            raise ValueError(f"checkpoint_every must be 0 or a positive multiple of page_size {ps}, "
                             f"got {checkpoint_every}")
        self.pool = pool
        self.page_size = ps
        self.has_swa = pool.has_swa
        self.window = pool.layout.window if self.has_swa else None
        self.checkpoint_every = checkpoint_every
        self.root = RadixNode(None, 0, [], [], [])
        self.root.full_lock = 1  # never evicted, never a leaf candidate
        self._nodes: dict[int, RadixNode] = {}
        self._holders: dict[Request, _Holder] = {}
        self._clock = 0
        self._full_lru = LruHeap(lambda n: n.is_leaf and n.full_lock == 0)
        self._swa_lru = LruHeap(self._swa_evictable)
        self.counters: Counter[str] = Counter()
        self.tiers = tiers
        if tiers is not None:
            tiers.attach(self)

    # ---- PrefixCache API ----------------------------------------------------------------------
    def match(self, request: Request, pool: DualKVPool) -> int:
        """Lock and hand out the longest window-safe cached prefix of ``request`` (page aligned,
        at least one token left to compute); returns its length in tokens."""
        self._check_pool(pool)
        if request in self._holders:
            raise RuntimeError(f"request {request.request_id} matched twice without release")
        if request.embeds is not None and not request.extra_keys:
            return 0  # placeholder ids without content keys cannot tell media apart: bypass the cache
        if self.tiers is not None and self.tiers.broken is not None:
            return 0  # a tier load failed: some tree pages may hold garbage, never hand them out
        limit = (request.num_tokens - 1) // self.page_size
        keys = page_keys(request.token_ids, request.extra_keys, self.page_size, 0, limit)
        nodes, valid = self._walk(keys)
        p = window_safe_pages(valid, len(valid), self.window, self.page_size)
        tail = self._cut(nodes, p)
        holder = _Holder(tail, 0, request.num_prompt_tokens)
        self._holders[request] = holder
        self._lock_path(holder, window_first_page(p, self.window, self.page_size))
        if self.tiers is not None:
            tail, p = self.tiers.extend_match(self, request, holder, keys, p)
        self._hand_out(request, tail, p)
        self.counters["queries"] += 1
        self.counters["query_tokens"] += request.num_tokens
        self.counters["hit_tokens"] += p * self.page_size
        return p * self.page_size

    def peek(self, request: Request) -> int:
        """Tokens ``match`` would hand out from L1 now (no locks, no tree changes): queue ordering."""
        if request.embeds is not None and not request.extra_keys or (self.tiers and self.tiers.broken):
            return 0
        limit = (request.num_tokens - 1) // self.page_size
        _, valid = self._walk(page_keys(request.token_ids, request.extra_keys, self.page_size, 0, limit))
        return window_safe_pages(valid, len(valid), self.window, self.page_size) * self.page_size

    def on_computed(self, request: Request, pool: DualKVPool) -> None:
        """Insert newly completed pages; drop this request's SWA contributions behind its window."""
        holder = self._holders.get(request)
        if holder is None:
            return
        upto = request.num_computed_tokens // self.page_size
        if upto > holder.tail.end:
            self._insert(request, holder, upto)
        self._advance_window(holder)
        if self.tiers is not None and request.num_computed_tokens >= request.num_prompt_tokens:
            self.tiers.on_prefill_end(self, request, holder.tail)

    def release(self, request: Request, pool: DualKVPool) -> None:
        """Finished or preempted: keep its computed pages in the tree (last window + checkpoints of
        SWA), unlock its path and drop the request's own page references."""
        holder = self._holders.pop(request, None)
        if holder is not None:
            upto = request.num_computed_tokens // self.page_size
            if upto > holder.tail.end:
                self._insert(request, holder, upto)
            self._advance_window(holder)
            self._unlock(holder)
        if self.tiers is not None:
            self.tiers.forget(request)
        pool.full.free(request.full_pages)
        pool.swa.free(request.swa_pages)

    def make_room(self, pool: DualKVPool, full_pages: int, swa_pages: int) -> None:
        """Called by the scheduler before an allocation would fail (before preempting anybody)."""
        self.evict(full_pages * self.page_size, swa_pages * self.page_size)

    def kv_buffers(self, pool: DualKVPool):
        """The pool, or a view whose ``layer(i)`` waits for pending tier loads of layer i."""
        return self.tiers.kv_buffers(pool) if self.tiers is not None else pool

    def close(self) -> None:
        """Write the tree down to the tiers and stop their threads (a restart then hits L3)."""
        if self.tiers is not None:
            self.tiers.close(self)

    # ---- public API ---------------------------------------------------------------------------
    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """Free at least the given tokens of Full and SWA KV if unlocked cache holds that much.

        Full: delete LRU unlocked leaves (with their SWA). SWA: first, in LRU order, tombstone internal
        nodes and drop leaves' SWA pages before their last window (Full KV stays; every leaf keeps its
        match point), then delete LRU leaves. A parent left as an unlocked tombstone leaf goes too.
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

    def clear(self) -> None:
        """Drop every cached page; raises if a request still holds part of the tree."""
        if self._holders:
            raise RuntimeError(f"cannot clear the prefix cache: {len(self._holders)} requests hold it")
        self.evict(self.pool.full.num_pages * self.page_size, self.pool.swa.num_pages * self.page_size)
        if self._nodes:
            raise AssertionError(f"{len(self._nodes)} nodes survived clear(): an eligible node had no LRU entry")

    def stats(self) -> dict[str, int]:
        """Counters (queries, hit tokens per tier, evictions, trims) and the tree's current size."""
        full = sum(len(n.full) for n in self._nodes.values())
        swa = sum(n.num_swa for n in self._nodes.values())
        out = dict(self.counters, tree_nodes=len(self._nodes), tree_full_pages=full, tree_swa_pages=swa,
                   tree_tombstones=sum(1 for n in self._nodes.values() if n.is_tombstone))
        if self.tiers is not None:
            out.update(self.tiers.stats())
        out["hit_tokens_l1"] = out.get("hit_tokens", 0) - out.get("hit_tokens_l2", 0) - out.get("hit_tokens_l3", 0)
        return out

    # ---- internal helpers: match ----------------------------------------------------------------
    def _check_pool(self, pool: DualKVPool) -> None:
        if pool is not self.pool:
            raise ValueError("the prefix cache was built for a different DualKVPool")

    def _walk(self, keys: list) -> tuple[list[tuple[RadixNode, int]], list[bool]]:
        """Nodes along the longest Full match of ``keys`` (with pages matched in each) + SWA validity."""
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
        return nodes, valid

    def _cut(self, nodes: list[tuple[RadixNode, int]], p: int) -> RadixNode:
        """The node ending exactly at path page ``p`` (splitting the one that contains it)."""
        if p == 0:
            return self.root
        for node, _ in nodes:
            if node.start < p <= node.end:
                if p < node.end:
                    node = self._split(node, p - node.start)
                return node
        raise AssertionError(f"page {p} is not on the matched path")

    def _hand_out(self, request: Request, tail: RadixNode, p: int) -> None:
        """Fill the request's page tables with the tree's first ``p`` pages (one reference each)."""
        full, swa = [0] * p, [-1] * p
        node = tail
        while node is not self.root:
            full[node.start:node.end] = node.full
            swa[node.start:node.end] = node.swa
            node = node.parent
        first = window_first_page(p, self.window, self.page_size)
        swa[:first] = [-1] * first
        self.pool.full.incref(full)
        self.pool.swa.incref([s for s in swa if s >= 0])
        request.full_pages, request.swa_pages, request.swa_released_pages = full, swa, first
        self._touch_path(tail)

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

    # ---- internal helpers: insert and lifecycle ---------------------------------------------------
    def _insert(self, request: Request, holder: _Holder, upto: int) -> None:
        """Put the request's pages [tail.end, upto) on its path, sharing existing nodes."""
        j, node = holder.tail.end, holder.tail
        keys = page_keys(request.token_ids, request.extra_keys, self.page_size, j, upto)
        hashes = self.tiers.page_hashes(request, upto) if self.tiers is not None else None
        k = 0
        while j + k < upto:
            child = node.children.get(keys[k])
            if child is None:
                self._add_pages(request, holder, node, keys[k:], j + k, upto, hashes)
                return
            n = 1
            while n < len(child.keys) and j + k + n < upto and child.keys[n] == keys[k + n]:
                n += 1
            if n < len(child.keys):
                child = self._split(child, n)
            for i in range(n):  # revive tombstoned SWA with the request's fresh KV
                s = request.swa_pages[child.start + i]
                if child.swa[i] < 0 and s >= 0:
                    self.pool.swa.incref([s])
                    child.swa[i] = s
                    holder.own_swa.append((child.start + i, s))
            child.full_lock += 1
            child.swa_lock += 1
            node, k = child, k + n
            holder.tail = node
            self._touch(node)
            if self.tiers is not None:
                self.tiers.backfill(self, node)

    def _add_pages(self, request: Request, holder: _Holder, parent: RadixNode, keys: list, start: int,
                   upto: int, hashes: list | None) -> None:
        full = request.full_pages[start:upto]
        swa = request.swa_pages[start:upto]
        self.pool.full.incref(full)
        self.pool.swa.incref([s for s in swa if s >= 0])
        holder.own_swa.extend((start + i, s) for i, s in enumerate(swa) if s >= 0)
        node_hashes = hashes[start:upto] if hashes is not None else None
        # A new node per step (never growing the tail in place): the SWA lock is per node, and a tail
        # grown over the whole request would pin all of its checkpoint windows while it runs.
        node = RadixNode(parent, start, list(keys), list(full), list(swa), node_hashes)
        parent.children[keys[0]] = node
        self._nodes[node.nid] = node
        node.full_lock = node.swa_lock = 1
        self._push(parent)  # no longer a leaf: now an SWA (tombstone) candidate
        holder.tail = node
        self._touch(node)

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

    # ---- internal helpers: tree surgery and LRU ----------------------------------------------------
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
        """Delete an unlocked leaf, then any parent left as an unlocked tombstone leaf (a leaf is never
        a tombstone). Returns (Full, SWA) pages freed."""
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
            if self.has_swa and parent.is_tombstone and parent.full_lock == 0:
                node = parent
                continue
            self._push(parent)  # newly a leaf: a Full eviction candidate
            break
        self.counters["evicted_full_pages"] += freed_full
        self.counters["evicted_swa_pages"] += freed_swa
        return freed_full, freed_swa

    # ---- integrity ------------------------------------------------------------------------------------
    def check_integrity(self, requests: list[Request] | None = None) -> None:
        """Raise AssertionError unless every invariant holds. With ``requests`` (every request that
        holds pages), also check each page's reference count == tree references + request references."""
        check_tree_integrity(self, requests)

    def holder_paths(self) -> list[tuple[RadixNode, int]]:
        """(tail, swa_lo) of every request holding the tree (for the integrity check)."""
        return [(h.tail, h.swa_lo) for h in self._holders.values()]

    def lru_entries(self) -> tuple[set, set]:
        return self._full_lru.live_entries(), self._swa_lru.live_entries()
