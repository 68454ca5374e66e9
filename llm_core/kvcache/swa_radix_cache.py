"""SWA-aware radix prefix cache over the dual KV pool (the scheduler's ``PrefixCache``).

Tree pages share physical pages with requests through the allocators' reference counts: the tree holds
one reference per page it lists, every request one per page in its tables. A match therefore only
copies page ids (and takes references); nothing is ever copied between slots in L1.

Window-safe matching (fake hits under SWA are wrong outputs, not misses; docs/kv_cache.md §3):

    W = 4, page_size 2                      tree path for the prompt (S = SWA kept, - = tombstoned)
    pages      0   1   2   3   4   5           Full:  0 1 2 3 4 5   all present
    SWA        -   -   S   -   S   S           to resume at P = 6 (p = 3 pages) keys 3..5 are needed
    resume at P = 12 (6 pages): needs pages 4, 5 -> valid -> match 12 tokens
    resume at P = 8  (4 pages): needs pages 2, 3 -> page 3 tombstoned -> not a candidate

Lifecycle (§7): a request's computed pages are inserted after every step (before the scheduler
releases the request's out-of-window SWA pages, so the tree can keep what it wants); the tree then
drops the SWA pages this request contributed once they fall behind the request's last window, except
periodic checkpoint windows (every ``checkpoint_every`` tokens), the windows ending at the request's
own checkpoints (``Request.checkpoints``: media and message ends) and the one ending at the prompt's
last whole page. A finished request thus leaves its Full KV, its last window of SWA KV, its prompt's and its
checkpoints.

The cache owns three collaborators and wires them together: the node store (``RadixTree``), the
per-request locks (``LockTable``) and the LRU orders with eviction (``EvictionPolicy``).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from llm_core.engine.request import Request
from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.eviction_policy import EvictionPolicy
from llm_core.kvcache.lock_table import Holder, LockTable
from llm_core.kvcache.page_keys import PageKey, page_keys
from llm_core.kvcache.prefix_cache import PrefixCache
from llm_core.kvcache.radix_node import RadixNode
from llm_core.kvcache.radix_tree import RadixTree, TreeMatch
from llm_core.kvcache.swa_window import keeps_swa, kept_window_ends, window_first_page, window_safe_pages

if TYPE_CHECKING:
    from llm_core.kvcache.tiers.kv_tiers import KVTiers


class SWARadixCache(PrefixCache):
    """Radix tree of page runs with Full pages, per-page SWA validity, two locks and two LRU orders."""

    def __init__(self, pool: DualKVPool, *, checkpoint_every: int = 0, tiers: KVTiers | None = None) -> None:
        """``checkpoint_every``: keep an SWA window every K tokens (0: off; a multiple of the page
        size). ``tiers``: an optional ``KVTiers`` (L2 host memory + L3 store, tiers/kv_tiers.py)."""
        ps = pool.page_size
        if checkpoint_every < 0 or checkpoint_every % ps:
            raise ValueError(f"checkpoint_every must be 0 or a positive multiple of page_size {ps}, "
                             f"got {checkpoint_every}")
        self.pool = pool
        self.page_size = ps
        self.has_swa = pool.has_swa
        self.window = pool.layout.window if self.has_swa else None
        self.checkpoint_every = checkpoint_every
        # The collaborators, each the only writer of its part of a node: structure and page tables
        # (tree), full_lock / swa_lock (locks), last_access and freeing the tree's pages (eviction).
        self.tree = RadixTree()
        self.locks = LockTable(self.tree.root, self.window, ps)
        self.eviction = EvictionPolicy(self.tree, pool, tiers)
        self.counters: Counter[str] = Counter()  # queries, query/hit tokens, trimmed SWA pages
        # an SWA page may be held twice (a request reads its own copy, the node lists another):
        # set where one is made (_insert, revive_swa), cleared by the fold that finds none left, so
        # make_room compares windows only while there may be something to fold
        self._swa_doubles = False
        self.tiers = tiers
        if tiers is not None:
            tiers.attach(self)

    # ---- PrefixCache API ----------------------------------------------------------------------
    def match(self, request: Request, pool: DualKVPool) -> int:
        """Lock and hand out the longest window-safe cached prefix of ``request`` (page aligned,
        at least one token left to compute); returns its length in tokens."""
        self._check_pool(pool)
        if request in self.locks:
            raise RuntimeError(f"request {request.request_id} matched twice without release")
        if not self._may_match(request):
            return 0
        keys = self._match_keys(request)
        found = self.tree.walk(keys)
        # a request that must compute its whole prompt (prompt logprobs) is held at the root: its
        # pages still go into the tree as they are computed, it takes none from it
        reads = request.reads_prefix_cache
        p = window_safe_pages(found.swa_valid, found.pages, self.window, self.page_size) if reads else 0
        kept = kept_window_ends(request.num_prompt_tokens, request.checkpoints, self.page_size)
        holder = self.locks.hold(request, self._cut(found, p), kept,
                                 window_first_page(p, self.window, self.page_size))
        if self.tiers is not None and reads:
            p = self.tiers.extend_match(self, request, holder, keys, p)
        self._hand_out(request, holder.tail, p)
        return p * self.page_size

    def admitted(self, request: Request) -> None:
        """Count the lookup: a request's first admission in queries / query_tokens (its prompt) /
        hit_tokens; a re-admission after a preemption apart (preempted_*: it looks up its
        generated tokens too, and finds its own pages), as vLLM's PrefixCacheStats does, so the
        hit rate stays the prompts'."""
        tag = "preempted_" if request.num_preemptions else ""
        self.counters[f"{tag}queries"] += 1
        self.counters[f"{tag}query_tokens"] += request.num_tokens
        self.counters[f"{tag}hit_tokens"] += request.num_cached_tokens

    def prefetch(self, request: Request) -> bool:
        """With an L3 tier: start fetching the pages L1 + L2 lack on the tier's fetch thread; False
        until they arrived or the load timed out (docs/kv_cache.md §8)."""
        if self.tiers is None or not self._may_match(request) or not request.reads_prefix_cache:
            return True
        return self.tiers.prefetch(self, request, self._match_keys(request))

    def peek(self, request: Request) -> int:
        """Tokens ``match`` would hand out from L1 now (no locks, no tree changes): queue ordering."""
        if not self._may_match(request) or not request.reads_prefix_cache:
            return 0
        found = self.tree.walk(self._match_keys(request))
        return window_safe_pages(found.swa_valid, found.pages, self.window, self.page_size) * self.page_size

    def on_computed(self, request: Request, pool: DualKVPool) -> None:
        """Insert newly completed pages; drop this request's SWA contributions behind its window."""
        holder = self.locks.get(request)
        if holder is None:
            return
        self._insert_computed(request, holder)
        if self.tiers is not None and request.num_computed_tokens >= request.num_prompt_tokens:
            self.tiers.on_prefill_end(request, holder.tail)

    def release(self, request: Request, pool: DualKVPool) -> None:
        """Finished or preempted: keep its computed pages in the tree (last window + checkpoints of
        SWA), unlock its path and drop the request's own page references."""
        holder = self.locks.pop(request)
        if holder is not None:
            self._insert_computed(request, holder)
            self._unlock(holder)
        if self.tiers is not None:
            self.tiers.forget(request)
        pool.full.free(request.full_pages)
        pool.swa.free(request.swa_pages)

    def make_room(self, pool: DualKVPool, full_pages: int, swa_pages: int) -> None:
        """Called by the scheduler before an allocation would fail (before preempting anybody):
        first the pages held twice (``EvictionPolicy.fold_copies``: nothing cached is lost), then eviction."""
        full = swa = 0
        if full_pages or swa_pages:
            full, swa, self._swa_doubles = self.eviction.fold_copies(self.locks, self._swa_doubles)
        self.evict(max(0, full_pages - full) * self.page_size, max(0, swa_pages - swa) * self.page_size)

    def kv_buffers(self, pool: DualKVPool):
        """The pool, or a view whose ``layer(i)`` waits for pending tier loads of layer i."""
        return self.tiers.kv_buffers(pool) if self.tiers is not None else pool

    def close(self) -> None:
        """Write the tree down to the tiers and stop their threads (a restart then hits L3)."""
        if self.tiers is not None:
            self.tiers.close(self.tree.nodes())

    def stats(self) -> dict[str, int]:
        """Counters (queries, hit tokens per tier, evictions, trims) and the tree's current size."""
        tree = self.tree
        out = dict(self.counters, **self.eviction.counters, tree_nodes=len(tree), tree_full_pages=tree.full_pages,
                   tree_swa_pages=tree.swa_pages, tree_tombstones=tree.tombstones)
        if self.tiers is not None:
            out.update(self.tiers.stats())
        out["hit_tokens_l1"] = out.get("hit_tokens", 0) - out.get("hit_tokens_l2", 0) - out.get("hit_tokens_l3", 0)
        return out

    # ---- public API -----------------------------------------------------------------------------
    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """Free at least this many tokens of Full and SWA KV held only by the tree, if unlocked nodes
        hold that much (see ``EvictionPolicy.evict``); returns the tokens freed (Full, SWA)."""
        return self.eviction.evict(full_tokens, swa_tokens)

    def clear(self) -> None:
        """Drop every cached page; raises if a request still holds part of the tree."""
        if len(self.locks):
            raise RuntimeError(f"cannot clear the prefix cache: {len(self.locks)} requests hold it")
        self.evict(self.pool.full.num_pages * self.page_size, self.pool.swa.num_pages * self.page_size)
        if len(self.tree):
            raise AssertionError(f"{len(self.tree)} nodes survived clear(): an eligible node had no LRU entry")

    # ---- interface for the tiers (tiers/kv_tiers.py) --------------------------------------------
    def rehold(self, holder: Holder, found: TreeMatch, pages: int, swa_from: int) -> RadixNode:
        """Move ``holder`` to the path of the first ``pages`` pages of ``found`` (SWA-locking the nodes
        that end after page ``swa_from``); returns its new tail."""
        self._unlock(holder)
        holder.tail = self._cut(found, pages)
        self.locks.lock_path(holder, swa_from)
        return holder.tail

    def narrow_window(self, holder: Holder) -> None:
        """Keep ``holder``'s SWA locks on its tail's last window only: a tier load that extended its
        match had also locked the window of the shorter L1 match (its fallback had the load found no
        room), whose SWA the request does not read; left locked it could not be evicted, and a lone
        request with a small SWA pool failed."""
        for node in self.locks.advance(holder):
            self.eviction.push(node)

    def revive_swa(self, tail: RadixNode, page: int, swa_page: int) -> None:
        """Give the tombstoned path page ``page`` (on the path ending at ``tail``) the SWA page
        ``swa_page``; the caller's reference on it passes to the tree."""
        node, i = tail.locate(page)
        assert node.swa[i] < 0, f"path page {page} of {node} still has its SWA page"
        self.tree.set_swa(node, i, swa_page)
        self._swa_doubles = True  # a request that computed the page itself may read its own copy
        self.eviction.push(node)

    def graft(self, holder: Holder, keys: list[PageKey], full: list[int], swa: list[int],
              hashes: list[bytes] | None) -> RadixNode:
        """Add a node below ``holder``'s tail holding these pages (the caller's references pass to the
        tree); ``holder`` locks it and it becomes the holder's tail."""
        parent = holder.tail
        node = self.tree.add(parent, keys, full, swa, hashes)
        self.eviction.push(parent)  # no longer a leaf: now an SWA (tombstone) candidate
        self.locks.extend(holder, node)
        self.eviction.touch(node)
        return node

    # ---- integrity ------------------------------------------------------------------------------
    def check_integrity(self, requests: list[Request] | None = None) -> None:
        """Raise AssertionError unless every invariant holds: the tree's structure (a leaf is never a
        tombstone, no page listed twice), lock counts recomputed from the holders, an LRU entry for
        every evictable node, and a reference on every page the tree lists. With ``requests`` (every
        request that holds pages), each page's reference count must equal tree + request references."""
        full_pages, swa_pages = self.tree.check_integrity(self.has_swa)
        self.locks.check_integrity(self.tree.nodes())
        self.eviction.check_integrity()
        self.pool.check_integrity()
        for p in full_pages:
            assert self.pool.full.refcount(p) >= 1, f"tree lists free Full page {p}"
        for s in swa_pages:
            assert self.pool.swa.refcount(s) >= 1, f"tree lists free SWA page {s}"
        if requests is None:
            return
        full_refs, swa_refs = Counter(full_pages), Counter(swa_pages)
        for r in requests:
            full_refs.update(r.full_pages)
            swa_refs.update(s for s in r.swa_pages if s >= 0)
        self.pool.full.check_refs(full_refs)
        self.pool.swa.check_refs(swa_refs)
        self.locks.check_reads()

    # ---- internal helpers: match ----------------------------------------------------------------
    def _check_pool(self, pool: DualKVPool) -> None:
        if pool is not self.pool:
            raise ValueError("the prefix cache was built for a different DualKVPool")

    def _may_match(self, request: Request) -> bool:
        if request.embeds is not None and not request.extra_keys:
            return False  # placeholder ids without content keys cannot tell media apart: bypass the cache
        # a tier load failed: some tree pages may hold garbage, never hand them out
        return self.tiers is None or self.tiers.broken is None

    def _match_keys(self, request: Request) -> list[PageKey]:
        """Keys of the request's whole pages that may come from the cache (one token stays to compute)."""
        limit = (request.num_tokens - 1) // self.page_size
        return page_keys(request.token_ids, request.extra_keys, self.page_size, 0, limit)

    def _cut(self, found: TreeMatch, p: int) -> RadixNode:
        """The node ending exactly at path page ``p`` (splitting the one that contains it)."""
        if p == 0:
            return self.tree.root
        for node, _ in found.nodes:
            if node.start < p <= node.end:
                if p < node.end:
                    node = self._split(node, p - node.start)
                return node
        raise AssertionError(f"page {p} is not on the matched path")

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        head = self.tree.split(node, k)
        self.eviction.push(head)
        return head

    def _hand_out(self, request: Request, tail: RadixNode, p: int) -> None:
        """Fill the request's page tables with the tree's first ``p`` pages (one reference each)."""
        full, swa = [0] * p, [-1] * p
        for node in self.tree.path(tail):
            full[node.start:node.end] = node.full
            swa[node.start:node.end] = node.swa
        first = window_first_page(p, self.window, self.page_size)
        swa[:first] = [-1] * first
        self.pool.full.incref(full)
        self.pool.swa.incref([s for s in swa if s >= 0])
        request.full_pages, request.swa_pages, request.swa_released_pages = full, swa, first
        self.eviction.touch_path(tail)

    # ---- internal helpers: insert and window --------------------------------------------------------
    def _insert_computed(self, request: Request, holder: Holder) -> None:
        """Put the request's newly completed pages on the tree, then move its window."""
        upto = request.num_computed_tokens // self.page_size
        if upto > holder.tail.end:
            self._insert(request, holder, upto)
        self._advance_window(holder)

    def _insert(self, request: Request, holder: Holder, upto: int) -> None:
        """Put the request's pages [tail.end, upto) on its path, sharing existing nodes."""
        j, node = holder.tail.end, holder.tail
        keys = page_keys(request.token_ids, request.extra_keys, self.page_size, j, upto)
        hashes = self.tiers.page_hashes(request, upto) if self.tiers is not None else None
        k = 0
        while j + k < upto:
            child = node.children.get(keys[k])
            if child is None:
                self._add_pages(request, holder, keys[k:], upto, hashes)
                return
            n = 1
            while n < len(child.keys) and j + k + n < upto and child.keys[n] == keys[k + n]:
                n += 1
            if n < len(child.keys):
                child = self._split(child, n)
            for i in range(n):
                # pages the request computed again (it matched less: SWA behind a window was trimmed
                # or prompt logprobs): held once where nobody else reads the node's copy
                if not self.eviction.take_copy(child, i, request.full_pages[child.start + i], "full"):
                    holder.copies.append(child.start + i)
                s = request.swa_pages[child.start + i]  # tombstoned SWA revives with its fresh KV
                if child.swa[i] < 0 and s >= 0:
                    self.pool.swa.incref([s])
                    self.tree.set_swa(child, i, s)
                    holder.own_swa.append((child.start + i, s))
                    self._swa_doubles = True  # another request may read its own copy of the page
                elif s >= 0 and not self.eviction.take_copy(child, i, s, "sliding"):
                    self._swa_doubles = True  # a window the node kept, another request reads: folded later
            self.locks.extend(holder, child)
            node, k = child, k + n
            self.eviction.touch(node)
            if self.tiers is not None:
                self.tiers.backfill(node)

    def _add_pages(self, request: Request, holder: Holder, keys: list[PageKey], upto: int,
                   hashes: list[bytes] | None) -> None:
        start = holder.tail.end
        full = request.full_pages[start:upto]
        swa = request.swa_pages[start:upto]
        self.pool.full.incref(full)
        self.pool.swa.incref([s for s in swa if s >= 0])
        holder.own_swa.extend((start + i, s) for i, s in enumerate(swa) if s >= 0)
        # A new node per step (never growing the tail in place), and the step's pages behind the
        # window a node of their own: the SWA lock is per node, and one node over a long chunk would
        # pin every checkpoint window in it while the request's window overlaps its end (a lone
        # request with a small SWA pool then found nothing to evict and failed).
        cut = window_first_page(upto, self.window, self.page_size) - start if self.has_swa else 0
        for a, b in ((0, cut), (cut, upto - start)) if 0 < cut < upto - start else ((0, upto - start),):
            self.graft(holder, keys[a:b], full[a:b], swa[a:b],
                       hashes[start + a:start + b] if hashes is not None else None)

    def _advance_window(self, holder: Holder) -> None:
        """Move the SWA locks to the tail's last window; drop the SWA pages this request gave the tree
        that fell behind it, unless a checkpoint, the prompt's last window or another running
        request's window keeps them.

        A decode step completes a page only every page_size tokens; in between the request's tail,
        its window and its path (which only a split edits) are those of the last advance, which
        then has nothing to unlock and no contribution behind the window to drop: skipped (a b32
        decode step walked ~6 path nodes per request for nothing, ~0.2 ms in Python)."""
        if holder.advanced == (holder.tail, holder.tail.end, holder.swa_lo, self.tree.splits):
            return
        want = window_first_page(holder.tail.end, self.window, self.page_size)
        self._cut_at_window(holder, want)
        for node in self.locks.advance(holder):
            self.eviction.push(node)
        node = holder.tail
        for page, phys in reversed(holder.take_own_swa_before(want)):
            if keeps_swa(page, holder.kept_ends, self.checkpoint_every, self.window, self.page_size):
                continue
            node, i = node.locate(page)
            if node.swa[i] == phys and not self.locks.in_other_window(holder, node, page):
                self.eviction.free_swa_page(node, i)
                self.counters["trimmed_swa_pages"] += 1
        holder.advanced = (holder.tail, holder.tail.end, holder.swa_lo, self.tree.splits)

    def _cut_at_window(self, holder: Holder, want: int) -> None:
        """Split the SWA-locked path node the window's first page ``want`` falls inside when its part
        behind the window holds SWA (a window kept for later: the prompt's last, a checkpoint): the
        lock is per node, and it kept that SWA, which this request no longer reads, from eviction
        while the window crossed the node (a lone request with a small SWA pool then failed). A part
        holding none is left whole: a long node is not cut page by page as the window moves."""
        node = holder.tail
        while node is not self.tree.root and node.start >= want:
            node = node.parent
        if node is not self.tree.root and want < node.end and node.end > holder.swa_lo and \
                any(s >= 0 for s in node.swa[:want - node.start]):
            self._split(node, want - node.start)

    def _unlock(self, holder: Holder) -> None:
        for node in self.locks.unlock(holder):
            self.eviction.push(node)
        tail = holder.tail  # a tombstone that became a leaf while locked goes now (leaf never tombstone)
        if tail is not self.tree.root and tail.alive and tail.is_leaf and tail.full_lock == 0 and \
                self.has_swa and tail.is_tombstone:
            self.eviction.delete_leaf(tail)
