"""L2 (host memory) and L3 (a key -> bytes store) behind the radix tree (L1 = the device pools).

    evict from L1 ──save──► L2 (HostKVPool) ──writer thread──► L3 (LocalDirStore / RedisStore)
    match past L1 ◄──loader thread, layer by layer── L2 ◄── staged ◄──fetch thread── L3
                                                     (before the match, the request waits: prefetch)

Pages are keyed by a hash chain of their contents (tokens + media keys) seeded with the model id, so
a restarted engine pointing at the same directory hits. L3 is never read on the engine thread:
``prefetch`` (asked by the scheduler before it matches a request) queues the reads of what L1 + L2
lack on the fetch thread (l3_prefetch.py), and the request is not matched until they are done or
time out; the match then answers from L1, L2 and the staged pages. Only Full rows and the SWA rows the tree
holds travel. A match that extends past L1 allocates L1 pages, records them in the tree and queues a
load job; the model reads KV through ``kv_buffers``, whose ``layer(i)`` waits until layer i of every
pending job has landed, so layer i computes while later layers are still copying. Consistency: SWA
that L1 holds and L2 lacks is back-filled at node merges and at prefill end; an L1/L2 hit touches
the L3 copies of the whole matched chain (one batched call, rate-limited) so hot prefixes do not
age out of L3. docs/kv_cache.md §8 has the picture.

The tiers change the tree only through the cache's tier interface (``rehold``, ``narrow_window``,
``revive_swa``, ``graft``, ``evict``) and read it through ``cache.tree``.

Without L2, what L3 holds is remembered per page (``_written``) so a page evicted again is not
rewritten: a page counts as written only once the store confirmed the put (the writer thread
reports it), and is forgotten when a match looks for it and it is not there (Redis restarted,
flushed, or aged it out), so a dropped or lost write is retried at the page's next eviction.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from llm_core.engine.request import Request
from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.tiers.host_kv_pool import HostKVPool, row_elements
from llm_core.kvcache.tiers.l3_prefetch import L3Prefetcher
from llm_core.kvcache.tiers.page_format import chain_seed, decode_page, gather_pages, page_hash
from llm_core.kvcache.tiers.tier_threads import WRITE_QUEUE_BYTES, KVTierThreads, LayerCopies, add_layer_copies
from llm_core.kvcache.lock_table import Holder
from llm_core.kvcache.page_keys import PageKey, page_keys
from llm_core.kvcache.radix_node import RadixNode
from llm_core.kvcache.radix_tree import TreeMatch
from llm_core.kvcache.swa_window import window_first_page, window_safe_pages
from llm_core.storage import KeyValueStore

if TYPE_CHECKING:
    from llm_core.kvcache.swa_radix_cache import SWARadixCache


@dataclass
class _TierPage:
    full: torch.Tensor | None
    swa: torch.Tensor | None
    tier: str  # "l2" | "l3"


class KVTiers:
    """L2 + L3 behind one ``SWARadixCache`` (see the module docstring); owns the loader and writer
    threads (``threads``). Engine-thread methods: extend_match, save, backfill, kv_buffers; the
    threads only copy."""

    def __init__(self, pool: DualKVPool, *, host: HostKVPool | None, store: KeyValueStore | None,
                 model_id: str, touch_interval_s: float = 30.0, l3_load_timeout_s: float = 1.0,
                 write_queue_bytes: int = WRITE_QUEUE_BYTES) -> None:
        """``write_queue_bytes``: rows of evicted pages waiting for the L3 writer, at most (past it
        a write is dropped, see tier_threads.py)."""
        if host is None and store is None:
            raise ValueError("KVTiers needs an L2 host pool, an L3 store, or both")
        self.pool, self.host, self.store = pool, host, store
        self.ps = pool.page_size
        self.window = pool.layout.window if pool.has_swa else None
        self.full_elems = row_elements(pool.layout, "full", self.ps)
        self.swa_elems = row_elements(pool.layout, "sliding", self.ps)
        self.seed = chain_seed(model_id, pool.layout, self.ps, pool.dtype)
        self.touch_interval_s = touch_interval_s
        self.counters: Counter[str] = Counter()
        self.threads = KVTierThreads(pool, store, on_written=self._mark_written,
                                     write_queue_bytes=write_queue_bytes)
        self.prefetcher = L3Prefetcher(store, self._decode, l3_load_timeout_s) if store is not None else None
        self._hashes: dict[Request, list[bytes]] = {}  # request -> its page hash chain so far
        self._backfilled: set[Request] = set()
        self._touched: OrderedDict[bytes, float] = OrderedDict()
        self._written: OrderedDict[bytes, bool] = OrderedDict()  # hash -> the store kept it, with SWA? (L3 only)
        self._written_lock = threading.Lock()  # the writer thread marks, the engine thread reads and forgets

    @property
    def broken(self) -> BaseException | None:
        """The error of a failed load: the cache stops trusting the tree (L1 may hold garbage)."""
        return self.threads.broken

    def attach(self, cache: SWARadixCache) -> None:
        if cache.pool is not self.pool:
            raise ValueError("KVTiers and the prefix cache must share one DualKVPool")

    # ---- hashes ---------------------------------------------------------------------------------
    def page_hashes(self, request: Request, upto: int) -> list[bytes]:
        chain = self._hashes.setdefault(request, [])
        if len(chain) < upto:
            prev = chain[-1] if chain else self.seed
            for key in page_keys(request.token_ids, request.extra_keys, self.ps, len(chain), upto):
                prev = page_hash(prev, key)
                chain.append(prev)
        return chain

    def forget(self, request: Request) -> None:
        self._hashes.pop(request, None)
        self._backfilled.discard(request)
        if self.prefetcher is not None:
            self.prefetcher.forget(request)

    # ---- L3 reads, before the match (off the engine thread) ---------------------------------------
    def prefetch(self, cache: SWARadixCache, request: Request, keys: list[PageKey]) -> bool:
        """Start reading from L3 the pages of ``keys`` that L1 + L2 cannot supply; False while the
        request should wait for them (l3_prefetch.py)."""
        if self.prefetcher is None or not keys:
            return True
        if not self.prefetcher.started(request):
            self.prefetcher.start(request, self._l3_wanted(cache, request, keys))
        return self.prefetcher.ready(request)

    def _l3_wanted(self, cache: SWARadixCache, request: Request, keys: list[PageKey]) -> list[tuple[bytes, bool]]:
        """(hash, a miss ends the chain) of every page a longer match could use that neither L1, L2
        nor the staged pages hold: past the L1 match every page, before it the SWA of the pages in
        the windows of longer matches."""
        hashes = self.page_hashes(request, len(keys))
        found = cache.tree.walk(keys)
        valid, m1 = found.swa_valid, found.pages
        p = window_safe_pages(valid, m1, self.window, self.ps)
        first = m1 if self.window is None else window_first_page(p + 1, self.window, self.ps)
        wanted = []
        for j in range(first, len(keys)):
            h = hashes[j]
            if (j < m1 and valid[j]) or self.prefetcher.has(h):
                continue
            entry = self.host.entries.get(h) if self.host is not None else None
            if entry is not None and (entry.swa_row >= 0 or not self.pool.has_swa):
                continue
            wanted.append((h, j >= m1 and entry is None))
        return wanted

    def _decode(self, raw: bytes):
        return decode_page(raw, self.pool.dtype, self.full_elems, self.swa_elems)

    # ---- match past L1 ----------------------------------------------------------------------------
    def extend_match(self, cache: SWARadixCache, request: Request, holder: Holder, keys: list[PageKey],
                     p: int) -> int:
        """Extend an L1 window-safe match of ``p`` pages with pages from L2/L3; returns the pages
        matched now (``holder``'s tail ends there)."""
        limit = len(keys)
        if limit == 0:
            return p
        hashes = self.page_hashes(request, limit)
        if self.prefetcher is not None:
            self.prefetcher.take(request)
        in_l1 = cache.tree.walk(keys)
        valid = in_l1.swa_valid
        m1, found, memo = len(valid), {}, {}
        while m1 + len(found) < limit:
            page = self._lookup(hashes[m1 + len(found)], memo)
            if page is None or page.full is None:
                break
            found[m1 + len(found)] = page
        self._forget_written(hashes[m1 + len(found):limit])  # past a missing page L3 is no use: rewrite all
        has_swa = lambda j: (valid[j] if j < m1 else False) or self._swa_of(j, hashes, found, memo)  # noqa: E731
        p2 = p
        for cand in range(m1 + len(found), p, -1):
            if all(has_swa(j) for j in range(window_first_page(cand, self.window, self.ps), cand)):
                p2 = cand
                break
        if p2 == p:
            self._touch_l3(hashes[:p])
            return p
        return self._materialize(cache, holder, keys, hashes, in_l1, found, memo, p, p2, request.num_preemptions > 0)

    def _materialize(self, cache: SWARadixCache, holder: Holder, keys: list[PageKey], hashes: list[bytes],
                     in_l1: TreeMatch, found: dict[int, _TierPage], memo: dict, p: int, p2: int,
                     preempted: bool = False) -> int:
        valid = in_l1.swa_valid
        m1, first = len(valid), window_first_page(p2, self.window, self.ps)
        # SWA-lock the L1 match's window too: if loading finds no room we fall back to it
        cache.rehold(holder, in_l1, min(m1, p2), min(first, window_first_page(p, self.window, self.ps)))
        need_swa = [j for j in range(first, p2) if j >= m1 or not valid[j]] if self.pool.has_swa else []
        short_full = max(0, p2 - m1) - self.pool.full.num_free
        short_swa = len(need_swa) - self.pool.swa.num_free
        if short_full > 0 or short_swa > 0:
            cache.evict(max(0, short_full) * self.ps, max(0, short_swa) * self.ps)
        if max(0, p2 - m1) > self.pool.full.num_free or len(need_swa) > self.pool.swa.num_free:
            cache.rehold(holder, cache.tree.walk(keys), p, window_first_page(p, self.window, self.ps))
            self.counters["load_no_room"] += 1  # keep the L1 match
            return p
        full_pages = self.pool.full.allocate(max(0, p2 - m1))
        swa_pages = dict(zip(need_swa, self.pool.swa.allocate(len(need_swa))))
        copies: LayerCopies = {}
        for j, s in swa_pages.items():
            if j < m1:  # revive a tombstoned L1 page from the tier
                cache.revive_swa(holder.tail, j, s)
        if p2 > m1:
            swa = [swa_pages.get(j, -1) for j in range(m1, p2)]
            cache.graft(holder, list(keys[m1:p2]), full_pages, swa, list(hashes[m1:p2]))
            add_layer_copies(copies, self.pool, "full", full_pages, [found[j].full for j in range(m1, p2)])
        swa_src = [found[j].swa if j >= m1 else memo[hashes[j]].swa for j in swa_pages]
        add_layer_copies(copies, self.pool, "sliding", list(swa_pages.values()), swa_src)
        self.threads.submit(copies)
        # per tier, as the cache's hit_tokens (SWARadixCache.admitted): a re-match after a preemption apart
        tag = "preempted_" if preempted else ""
        for j in range(m1, p2):
            self.counters[f"{tag}hit_tokens_{found[j].tier}"] += self.ps
        if min(m1, p2) > p:  # L1 Full pages made usable by SWA windows from the tiers
            tier = (found.get(p2 - 1) or memo[hashes[p2 - 1]]).tier if p2 - 1 in swa_pages else "l2"
            self.counters[f"{tag}hit_tokens_{tier}"] += (min(m1, p2) - p) * self.ps
        self.counters["swa_pages_loaded"] += len(swa_pages)
        self._touch_l3(hashes[:p2])
        cache.narrow_window(holder)  # the fallback's window is not read now: its SWA may be evicted
        return p2

    def _lookup(self, h: bytes, memo: dict) -> _TierPage | None:
        """The page from L2, else from the pages the L3 prefetch staged (then also placed in L2);
        memoized per match. Never reads L3 itself: that is the fetch thread's job."""
        if h in memo:
            return memo[h]
        page = None
        entry = self.host.get(h) if self.host is not None else None
        if entry is not None:
            swa = self.host.swa_data[entry.swa_row].clone() if entry.swa_row >= 0 else None
            page = _TierPage(self.host.full_data[entry.full_row].clone(), swa, "l2")
            if swa is None and self.prefetcher is not None and (staged := self.prefetcher.get(h)) is not None:
                page = _TierPage(page.full, staged[1], "l3" if staged[1] is not None else "l2")
        elif self.prefetcher is not None and (staged := self.prefetcher.get(h)) is not None:
            page = _TierPage(staged[0], staged[1], "l3")
            if self.host is not None:
                self.host.put(h, staged[0], staged[1])
        if page is None:  # not in L3 either (or not read in time): write it again at its next eviction
            self._forget_written([h])
        memo[h] = page
        return page

    def _swa_of(self, j: int, hashes: list[bytes], found: dict[int, _TierPage], memo: dict) -> bool:
        page = found.get(j) or self._lookup(hashes[j], memo)
        return page is not None and page.swa is not None

    # ---- L1 -> L2 -> L3 -------------------------------------------------------------------------------
    def save(self, node: RadixNode) -> None:
        """Called before L1 frees ``node``'s pages: copy what the tiers lack (Full + valid SWA)."""
        self.threads.wait_loads()  # first: a failed load's queued copies still land in these pages
        if node.hashes is None or self.broken is not None:  # after a failed load L1 may hold garbage
            return
        todo = [i for i, h in enumerate(node.hashes) if self._lacks(h, node.swa[i] >= 0)]
        if not todo:
            return
        full = gather_pages(self.pool, "full", [node.full[i] for i in todo])
        swa = gather_pages(self.pool, "sliding", [node.swa[i] for i in todo]) if self.pool.has_swa else None
        for r, i in enumerate(todo):
            row_swa = swa[r] if swa is not None and node.swa[i] >= 0 else None
            self._store(node.hashes[i], full[r], row_swa)
        self.counters["pages_saved"] += len(todo)

    def on_prefill_end(self, request: Request, tail: RadixNode) -> None:
        """Once per request: back-fill L2 with the SWA of its last window (L1 has it, L2 may not)."""
        if request in self._backfilled:
            return
        self._backfilled.add(request)
        first = window_first_page(tail.end, self.window, self.ps)
        node = tail
        while node.parent is not None and node.end > first:  # up to, not including, the root
            self.backfill(node)
            node = node.parent

    def backfill(self, node: RadixNode) -> None:
        """L1 holds SWA that L2 lacks (node merge, prefill end): copy it down now."""
        if self.host is None or node.hashes is None or not self.pool.has_swa or self.broken is not None:
            return
        todo = [i for i, h in enumerate(node.hashes)
                if node.swa[i] >= 0 and (e := self.host.entries.get(h)) is not None and e.swa_row < 0]
        if not todo:
            return
        self.threads.wait_loads()
        swa = gather_pages(self.pool, "sliding", [node.swa[i] for i in todo])
        for r, i in enumerate(todo):
            entry = self.host.put(node.hashes[i], None, swa[r])
            if entry is not None and self.store is not None:
                self.threads.put(node.hashes[i], self.host.full_data[entry.full_row].clone(), swa[r])
        self.counters["swa_pages_backfilled"] += len(todo)

    def _lacks(self, h: bytes, with_swa: bool) -> bool:
        if self.host is not None:
            e = self.host.entries.get(h)
            return e is None or (with_swa and e.swa_row < 0)
        with self._written_lock:
            had = self._written.get(h)
        return had is None or (with_swa and not had)

    def _store(self, h: bytes, full: torch.Tensor, swa: torch.Tensor | None) -> None:
        if self.host is not None:
            entry = self.host.put(h, full, swa)
            if entry is not None and swa is None and entry.swa_row >= 0:
                swa = self.host.swa_data[entry.swa_row].clone()
        if self.store is not None:
            self.threads.put(h, full, swa)  # marked written by the writer thread once the store kept it

    def _mark_written(self, h: bytes, with_swa: bool) -> None:
        """Writer thread: the store kept page ``h`` (the latest put of a page is what the store holds)."""
        with self._written_lock:
            self._written[h] = with_swa
            self._written.move_to_end(h)
            while len(self._written) > 1_000_000:
                self._written.popitem(last=False)

    def _forget_written(self, hashes: list[bytes]) -> None:
        """A lookup did not find these pages: L3 may have lost them, so their next eviction writes them."""
        if self.store is None or not hashes:
            return
        with self._written_lock:
            for h in hashes:
                self._written.pop(h, None)

    def _touch_l3(self, chain: list[bytes]) -> None:
        """Keep a matched chain alive in L3: every page of it, in one batched store call (an
        expired early page would break the chain for every later one). Rate-limited per chain."""
        if self.store is None or not chain:
            return
        h, now = chain[-1], time.monotonic()
        if now - self._touched.get(h, -1e18) < self.touch_interval_s:
            return
        self._touched[h] = now
        self._touched.move_to_end(h)
        while len(self._touched) > 100_000:
            self._touched.popitem(last=False)
        self.threads.touch(list(chain))

    # ---- lifecycle ---------------------------------------------------------------------------------
    def kv_buffers(self, pool: DualKVPool):
        """The pool, or a view whose ``layer(i)`` waits for pending loads of layer i."""
        return self.threads.kv_buffers(pool)

    def flush(self, nodes: Iterable[RadixNode] = ()) -> None:
        """Copy the L1 pages of ``nodes`` (the cache passes its whole tree) down, and wait for
        pending L3 writes."""
        for node in nodes:
            self.save(node)
        self.threads.join_writes()

    def close(self, nodes: Iterable[RadixNode] = ()) -> None:
        """Copy the L1 pages of ``nodes`` down, then stop the loader and writer threads (pending L3
        writes get ``CLOSE_TIMEOUT_S``, see tier_threads.py) and close the store."""
        for node in nodes:
            self.save(node)
        if self.prefetcher is not None:
            self.prefetcher.stop()
        self.threads.stop()

    def stats(self) -> dict[str, int]:
        out = dict(self.counters, **self.threads.stats())
        if self.prefetcher is not None:
            out.update(self.prefetcher.counters, l3_loads_in_flight=self.prefetcher.in_flight())
        if self.host is not None:
            out.update(l2_entries=len(self.host.entries), l2_evictions=self.host.evictions)
        return out
