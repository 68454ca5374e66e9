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

from collections import Counter

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.radix_eviction import RadixEviction
from llm_core.kvcache.radix_locks import RadixLocks, _Holder
from llm_core.kvcache.radix_node import RadixNode, check_tree_integrity, page_keys, window_first_page, window_safe_pages
from llm_core.engine.request import Request
from llm_core.engine.scheduler import PrefixCache


class SWARadixCache(RadixLocks, RadixEviction, PrefixCache):
    """Radix tree of page runs with Full pages, per-page SWA validity, two LRU orders and two locks.

    Lock bookkeeping lives in :class:`RadixLocks`, LRU orders and eviction in :class:`RadixEviction`."""

    def __init__(self, pool: DualKVPool, *, checkpoint_every: int = 0, tiers=None) -> None:
        """``checkpoint_every``: keep an SWA window every K tokens (0: off; a multiple of the page
        size). ``tiers``: an optional :class:`llm_core.kvcache.kv_tiers.KVTiers` (L2 host memory + L3 store)."""
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
        self._init_eviction()
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

    # ---- public API (also ``evict`` from RadixEviction) ------------------------------------------
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

    # ---- internal helpers: insert ----------------------------------------------------------------
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

    # ---- integrity ------------------------------------------------------------------------------------
    def check_integrity(self, requests: list[Request] | None = None) -> None:
        """Raise AssertionError unless every invariant holds. With ``requests`` (every request that
        holds pages), also check each page's reference count == tree references + request references."""
        check_tree_integrity(self, requests)
