"""L2 (host memory) and L3 (a key -> bytes store) behind the radix tree (L1 = the device pools).

    evict from L1 ──save──► L2 (HostKVPool) ──writer thread──► L3 (LocalDirStore / RedisStore)
    match past L1 ◄──loader thread, layer by layer── L2 ◄── L3

Pages are keyed by a hash chain of their contents (tokens + media keys) seeded with the model id, so
a restarted engine pointing at the same directory hits. Only Full rows and the SWA rows the tree
holds travel. A match that extends past L1 allocates L1 pages, records them in the tree and queues a
load job; the model reads KV through ``kv_buffers``, whose ``layer(i)`` waits until layer i of every
pending job has landed, so layer i computes while later layers are still copying. Consistency: SWA
that L1 holds and L2 lacks is back-filled at node merges and at prefill end; an L1/L2 hit touches
the L3 copy (rate-limited) so hot prefixes do not age out of L3.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.host_kv_pool import HostKVPool, chain_seed, decode_page, gather_pages, page_hash, row_elements
from llm_core.kvcache.kv_tier_threads import KVTierThreads, LayerwiseKV, LoadJob, _store_key
from llm_core.kvcache.prefix_cache_factory import build_prefix_cache, weights_fingerprint
from llm_core.kvcache.radix_node import RadixNode, page_keys, window_first_page
from llm_core.storage import KeyValueStore

# Names that lived here before the threads and the factory got their own modules (kept importable).
__all__ = ["KVTiers", "LayerwiseKV", "LoadJob", "build_prefix_cache", "weights_fingerprint"]


@dataclass
class _TierPage:
    full: torch.Tensor | None
    swa: torch.Tensor | None
    tier: str  # "l2" | "l3"


class KVTiers(KVTierThreads):
    """L2 + L3 behind one ``SWARadixCache`` (see the module docstring); owns the loader and writer
    threads (:class:`KVTierThreads`). Engine-thread methods: extend_match, save, backfill, kv_buffers;
    the threads only copy."""

    def __init__(self, pool: DualKVPool, *, host: HostKVPool | None, store: KeyValueStore | None,
                 model_id: str, touch_interval_s: float = 30.0) -> None:
        if host is None and store is None:
            raise ValueError("KVTiers needs an L2 host pool, an L3 store, or both")
        self.pool, self.host, self.store = pool, host, store
        self.ps = pool.page_size
        self.full_elems = row_elements(pool.layout, "full", self.ps)
        self.swa_elems = row_elements(pool.layout, "sliding", self.ps)
        self.seed = chain_seed(model_id, pool.layout, self.ps, pool.dtype)
        self.touch_interval_s = touch_interval_s
        self.broken: BaseException | None = None  # a load failed: the cache stops trusting the tree
        self.counters: Counter[str] = Counter()
        self._hashes: dict = {}  # request -> its page hash chain so far
        self._backfilled: set = set()
        self._touched: OrderedDict[bytes, float] = OrderedDict()
        self._written: OrderedDict[bytes, bool] = OrderedDict()  # hash -> written with SWA (L3 only)
        self._start_threads()

    def attach(self, cache) -> None:
        if cache.pool is not self.pool:
            raise ValueError("KVTiers and the prefix cache must share one DualKVPool")

    # ---- hashes ---------------------------------------------------------------------------------
    def page_hashes(self, request, upto: int) -> list[bytes]:
        chain = self._hashes.setdefault(request, [])
        if len(chain) < upto:
            prev = chain[-1] if chain else self.seed
            for key in page_keys(request.token_ids, request.extra_keys, self.ps, len(chain), upto):
                prev = page_hash(prev, key)
                chain.append(prev)
        return chain

    def forget(self, request) -> None:
        self._hashes.pop(request, None)
        self._backfilled.discard(request)

    # ---- match past L1 ----------------------------------------------------------------------------
    def extend_match(self, cache, request, holder, keys: list, p: int) -> tuple[RadixNode, int]:
        """Extend an L1 window-safe match ``p`` with pages from L2/L3; returns (tail, pages)."""
        limit = len(keys)
        if limit == 0:
            return holder.tail, p
        hashes = self.page_hashes(request, limit)
        nodes, valid = cache._walk(keys)
        m1, found, memo = len(valid), {}, {}
        while m1 + len(found) < limit:
            page = self._lookup(hashes[m1 + len(found)], memo)
            if page is None or page.full is None:
                break
            found[m1 + len(found)] = page
        has_swa = lambda j: (valid[j] if j < m1 else False) or self._swa_of(j, hashes, found, memo)  # noqa: E731
        w, p2 = cache.window, p
        for cand in range(m1 + len(found), p, -1):
            if all(has_swa(j) for j in range(window_first_page(cand, w, self.ps), cand)):
                p2 = cand
                break
        if p2 == p:
            self._touch_l3(hashes[p - 1] if p else None)
            return holder.tail, p
        return self._materialize(cache, holder, keys, hashes, nodes, valid, found, memo, p, p2)

    def _materialize(self, cache, holder, keys, hashes, nodes, valid, found, memo, p, p2):
        m1, first = len(valid), window_first_page(p2, cache.window, self.ps)
        cache._unlock(holder)
        holder.tail = cache._cut(nodes, min(m1, p2))
        # SWA-lock the L1 match's window too: if loading finds no room we fall back to it
        cache._lock_path(holder, min(first, window_first_page(p, cache.window, self.ps)))
        need_swa = [j for j in range(first, p2) if j >= m1 or not valid[j]] if cache.has_swa else []
        short_full = max(0, p2 - m1) - self.pool.full.num_free
        short_swa = len(need_swa) - self.pool.swa.num_free
        if short_full > 0 or short_swa > 0:
            cache.evict(max(0, short_full) * self.ps, max(0, short_swa) * self.ps)
        if max(0, p2 - m1) > self.pool.full.num_free or len(need_swa) > self.pool.swa.num_free:
            cache._unlock(holder)  # no room to load: keep the L1 match
            holder.tail = cache._cut(cache._walk(keys)[0], p)
            cache._lock_path(holder, window_first_page(p, cache.window, self.ps))
            self.counters["load_no_room"] += 1
            return holder.tail, p
        full_pages = self.pool.full.allocate(max(0, p2 - m1))
        swa_pages = dict(zip(need_swa, self.pool.swa.allocate(len(need_swa))))
        copies: dict[int, list] = {}
        for j, s in swa_pages.items():
            if j < m1:  # revive a tombstoned L1 page from the tier
                node, i = holder.tail.locate(j)
                node.swa[i] = s
                cache._push(node)
        if p2 > m1:
            swa = [swa_pages.get(j, -1) for j in range(m1, p2)]
            node = RadixNode(holder.tail, m1, list(keys[m1:p2]), full_pages, swa, list(hashes[m1:p2]))
            holder.tail.children[node.keys[0]] = node
            cache._nodes[node.nid] = node
            cache._push(holder.tail)
            node.full_lock = node.swa_lock = 1
            holder.tail = node
            cache._touch(node)
            self._add_copies(copies, "full", full_pages, [found[j].full for j in range(m1, p2)])
        swa_src = [found[j].swa if j >= m1 else memo[hashes[j]].swa for j in swa_pages]
        self._add_copies(copies, "sliding", list(swa_pages.values()), swa_src)
        self._submit(copies)
        for j in range(m1, p2):
            self.counters[f"hit_tokens_{found[j].tier}"] += self.ps
        if min(m1, p2) > p:  # L1 Full pages made usable by SWA windows from the tiers
            tier = (found.get(p2 - 1) or memo[hashes[p2 - 1]]).tier if p2 - 1 in swa_pages else "l2"
            self.counters[f"hit_tokens_{tier}"] += (min(m1, p2) - p) * self.ps
        self.counters["swa_pages_loaded"] += len(swa_pages)
        self._touch_l3(hashes[p2 - 1])
        return holder.tail, p2

    def _lookup(self, h: bytes, memo: dict) -> _TierPage | None:
        """The page from L2, else from L3 (then also placed in L2); memoized per match."""
        if h in memo:
            return memo[h]
        page = None
        entry = self.host.get(h) if self.host is not None else None
        if entry is not None:
            swa = self.host.swa_data[entry.swa_row].clone() if entry.swa_row >= 0 else None
            page = _TierPage(self.host.full_data[entry.full_row].clone(), swa, "l2")
        elif self.store is not None:
            raw = self.store.get(_store_key(h))
            decoded = decode_page(raw, self.pool.dtype, self.full_elems, self.swa_elems) if raw else None
            if decoded is not None:
                page = _TierPage(decoded[0], decoded[1], "l3")
                if self.host is not None:
                    self.host.put(h, decoded[0], decoded[1])
            elif raw is not None:
                self.counters["l3_rejected"] += 1
        memo[h] = page
        return page

    def _swa_of(self, j: int, hashes: list, found: dict, memo: dict) -> bool:
        page = found.get(j) or self._lookup(hashes[j], memo)
        return page is not None and page.swa is not None

    # ---- L1 -> L2 -> L3 -------------------------------------------------------------------------------
    def save(self, cache, node: RadixNode) -> None:
        """Called before L1 frees ``node``'s pages: copy what the tiers lack (Full + valid SWA)."""
        if node.hashes is None or self.broken is not None:  # after a failed load L1 may hold garbage
            return
        self.wait_loads()
        todo = [i for i, h in enumerate(node.hashes) if self._lacks(h, node.swa[i] >= 0)]
        if not todo:
            return
        full = gather_pages(self.pool, "full", [node.full[i] for i in todo])
        swa = gather_pages(self.pool, "sliding", [node.swa[i] for i in todo]) if cache.has_swa else None
        for r, i in enumerate(todo):
            row_swa = swa[r] if swa is not None and node.swa[i] >= 0 else None
            self._store(node.hashes[i], full[r], row_swa)
        self.counters["pages_saved"] += len(todo)

    def on_prefill_end(self, cache, request, tail: RadixNode) -> None:
        """Once per request: back-fill L2 with the SWA of its last window (L1 has it, L2 may not)."""
        if request in self._backfilled:
            return
        self._backfilled.add(request)
        first = window_first_page(tail.end, cache.window, self.ps)
        node = tail
        while node is not cache.root and node.end > first:
            self.backfill(cache, node)
            node = node.parent

    def backfill(self, cache, node: RadixNode) -> None:
        """L1 holds SWA that L2 lacks (node merge, prefill end): copy it down now."""
        if self.host is None or node.hashes is None or not cache.has_swa or self.broken is not None:
            return
        todo = [i for i, h in enumerate(node.hashes)
                if node.swa[i] >= 0 and (e := self.host.entries.get(h)) is not None and e.swa_row < 0]
        if not todo:
            return
        self.wait_loads()
        swa = gather_pages(self.pool, "sliding", [node.swa[i] for i in todo])
        for r, i in enumerate(todo):
            entry = self.host.put(node.hashes[i], None, swa[r])
            if entry is not None and self.store is not None:
                self._writes.put(("put", node.hashes[i], self.host.full_data[entry.full_row].clone(), swa[r]))
        self.counters["swa_pages_backfilled"] += len(todo)

    def _lacks(self, h: bytes, with_swa: bool) -> bool:
        if self.host is not None:
            e = self.host.entries.get(h)
            return e is None or (with_swa and e.swa_row < 0)
        had = self._written.get(h)
        return had is None or (with_swa and not had)

    def _store(self, h: bytes, full: torch.Tensor, swa: torch.Tensor | None) -> None:
        if self.host is not None:
            entry = self.host.put(h, full, swa)
            if entry is not None and swa is None and entry.swa_row >= 0:
                swa = self.host.swa_data[entry.swa_row].clone()
        if self.store is not None:
            self._written[h] = swa is not None
            self._written.move_to_end(h)
            while len(self._written) > 1_000_000:
                self._written.popitem(last=False)
            self._writes.put(("put", h, full, swa))

    def _touch_l3(self, h: bytes | None) -> None:
        if self.store is None or h is None:
            return
        now = time.monotonic()
        if now - self._touched.get(h, -1e18) < self.touch_interval_s:
            return
        self._touched[h] = now
        self._touched.move_to_end(h)
        while len(self._touched) > 100_000:
            self._touched.popitem(last=False)
        self._writes.put(("touch", h, None, None))

    # ---- lifecycle ---------------------------------------------------------------------------------
    def flush(self, cache=None) -> None:
        """Copy every L1 tree page down (when ``cache`` is given) and wait for pending L3 writes."""
        if cache is not None:
            for node in list(cache._nodes.values()):
                self.save(cache, node)
        if self.store is not None:
            self._writes.join()

    def close(self, cache=None) -> None:
        """Flush (see ``flush``), then stop the loader and writer threads and close the store."""
        self.flush(cache)
        self._stop_threads()

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        if self.host is not None:
            out.update(l2_entries=len(self.host.entries), l2_evictions=self.host.evictions)
        return out
