"""The simplest correct prefix cache with the same rules as the radix tree, for tests.

No tree: a flat dict from every cached page *prefix* (the tuple of page keys up to and including that
page) to its [Full page, SWA page]. Every question is answered by brute force over that dict, so its
answers are easy to trust and slow to compute:

    entries[(k0,)]        = [17, -1]
    entries[(k0, k1)]     = [ 3,  9]       page 1 of this prefix still has SWA KV
    entries[(k0, k1, k2)] = [42,  5]

Same lifecycle as ``SWARadixCache``: computed pages are inserted after each step; SWA pages a request
contributed are dropped once behind its last window, unless they are checkpoint pages (periodic, or
the request's own ``checkpoints``) or inside another running request's last window; tombstoned SWA is revived by fresh KV. ``evict`` is a plain
LRU over unlocked pages; ``drop`` lets a test mirror another cache's eviction choices exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.page_keys import page_keys
from llm_core.kvcache.swa_window import is_checkpoint_page, window_first_page, window_safe_pages
from llm_core.engine.request import Request
from llm_core.kvcache.prefix_cache import PrefixCache

Prefix = tuple


@dataclass
class _Holder:
    keys: list  # page keys of the request's pages on the cache (its path)
    ends: list[int]  # positions whose windows stay: the prompt's last token and the request's checkpoints
    own: list[tuple[int, int]] = field(default_factory=list)  # (page, SWA page) it contributed


class NaivePrefixCache(PrefixCache):
    def __init__(self, pool: DualKVPool, *, checkpoint_every: int = 0) -> None:
        self.pool = pool
        self.ps = pool.page_size
        self.window = pool.layout.window if pool.has_swa else None
        self.checkpoint_every = checkpoint_every
        self.entries: dict[Prefix, list[int]] = {}
        self.last_access: dict[Prefix, int] = {}
        self.holders: dict[Request, _Holder] = {}
        self._clock = 0

    # ---- PrefixCache API ----------------------------------------------------------------------
    def match(self, request: Request, pool: DualKVPool) -> int:
        limit = (request.num_tokens - 1) // self.ps
        keys = page_keys(request.token_ids, request.extra_keys, self.ps, 0, limit)
        p = self._match_pages(keys)
        full = [self.entries[tuple(keys[:j + 1])][0] for j in range(p)]
        first = window_first_page(p, self.window, self.ps)
        swa = [-1] * first + [self.entries[tuple(keys[:j + 1])][1] for j in range(first, p)]
        pool.full.incref(full)
        pool.swa.incref([s for s in swa if s >= 0])
        request.full_pages, request.swa_pages, request.swa_released_pages = full, swa, first
        self.holders[request] = _Holder(keys[:p], [request.num_prompt_tokens - 1, *request.checkpoints])
        self._touch(keys[:p])
        return p * self.ps

    def peek(self, request: Request) -> int:
        limit = (request.num_tokens - 1) // self.ps
        return self._match_pages(page_keys(request.token_ids, request.extra_keys, self.ps, 0, limit)) * self.ps

    def on_computed(self, request: Request, pool: DualKVPool) -> None:
        holder = self.holders.get(request)
        if holder is not None:
            self._insert(request, holder)
            self._trim(holder)

    def release(self, request: Request, pool: DualKVPool) -> None:
        holder = self.holders.get(request)
        if holder is not None:
            self._insert(request, holder)
            self._trim(holder)
            del self.holders[request]
        pool.full.free(request.full_pages)
        pool.swa.free(request.swa_pages)

    def make_room(self, pool: DualKVPool, full_pages: int, swa_pages: int) -> None:
        self.evict(full_pages * self.ps, swa_pages * self.ps)

    # ---- public API ---------------------------------------------------------------------------
    def evict(self, full_tokens: int, swa_tokens: int) -> None:
        """LRU: delete unlocked leaf pages for Full; for SWA drop unlocked internal pages' SWA first,
        then delete unlocked leaf pages."""
        need_full, need_swa = -(-full_tokens // self.ps), -(-swa_tokens // self.ps)
        freed_full = freed_swa = 0
        locked = {tuple(h.keys[:j + 1]) for h in self.holders.values() for j in range(len(h.keys))}
        windows = self._window_prefixes()
        while freed_full < need_full:
            leaves = [k for k in self.entries if k not in locked and self._is_leaf(k)]
            if not leaves:
                break
            f, s = self.drop(min(leaves, key=self.last_access.__getitem__), "full")
            freed_full, freed_swa = freed_full + f, freed_swa + s
        for leaves in (False, True):
            while freed_swa < need_swa:
                cands = [k for k, e in self.entries.items() if e[1] >= 0 and k not in windows
                         and self._is_leaf(k) == leaves and not (leaves and k in locked)]
                if not cands:
                    break
                f, s = self.drop(min(cands, key=self.last_access.__getitem__), "full" if leaves else "swa")
                freed_full, freed_swa = freed_full + f, freed_swa + s

    def drop(self, prefix: Prefix, kind: str, cascade: bool = True) -> tuple[int, int]:
        """Drop the SWA (``kind="swa"``) or everything (``"full"``) of one cached page; a leaf left
        without SWA is deleted, and (``cascade``) so is each parent that becomes such a leaf.
        Returns pages freed. A test mirroring another cache's evictions passes ``cascade=False``."""
        entry = self.entries[prefix]
        freed_full = freed_swa = 0
        if entry[1] >= 0:
            freed_swa += self.pool.swa.refcount(entry[1]) == 1
            self.pool.swa.free([entry[1]])
            entry[1] = -1
        if kind == "swa" and not (cascade and self.window is not None and self._is_leaf(prefix)):
            return freed_full, freed_swa
        freed_full += self.pool.full.refcount(entry[0]) == 1
        self.pool.full.free([entry[0]])
        del self.entries[prefix], self.last_access[prefix]
        parent = prefix[:-1]
        locked = {tuple(h.keys[:j + 1]) for h in self.holders.values() for j in range(len(h.keys))}
        if (cascade and parent and self.window is not None and self._is_leaf(parent) and parent not in locked
                and self.entries[parent][1] < 0):
            f, s = self.drop(parent, "full")
            freed_full, freed_swa = freed_full + f, freed_swa + s
        return freed_full, freed_swa

    def state(self) -> dict[Prefix, tuple[bool, bool]]:
        """prefix -> (has Full, has SWA) for every cached page (compare with ``SWARadixCache``)."""
        return {k: (True, e[1] >= 0) for k, e in self.entries.items()}

    # ---- internal helpers ---------------------------------------------------------------------
    def _match_pages(self, keys: list) -> int:
        m = 0
        while m < len(keys) and tuple(keys[:m + 1]) in self.entries:
            m += 1
        valid = [self.entries[tuple(keys[:j + 1])][1] >= 0 for j in range(m)]
        return window_safe_pages(valid, m, self.window, self.ps)

    def _insert(self, request: Request, holder: _Holder) -> None:
        upto = request.num_computed_tokens // self.ps
        start = len(holder.keys)
        if upto <= start:
            return
        holder.keys += page_keys(request.token_ids, request.extra_keys, self.ps, start, upto)
        for j in range(start, upto):
            prefix = tuple(holder.keys[:j + 1])
            s = request.swa_pages[j]
            entry = self.entries.get(prefix)
            if entry is None:
                self.pool.full.incref([request.full_pages[j]])
                entry = self.entries[prefix] = [request.full_pages[j], -1]
            if entry[1] < 0 and s >= 0:
                self.pool.swa.incref([s])
                entry[1] = s
                holder.own.append((j, s))
        self._touch(holder.keys)

    def _trim(self, holder: _Holder) -> None:
        want = window_first_page(len(holder.keys), self.window, self.ps)
        windows = self._window_prefixes(exclude=holder)
        keep = []
        for page, phys in holder.own:
            if page >= want:
                keep.append((page, phys))
                continue
            prefix = tuple(holder.keys[:page + 1])
            if (self._kept(page, holder) or prefix in windows
                    or self.entries[prefix][1] != phys):
                continue
            self.pool.swa.free([phys])
            self.entries[prefix][1] = -1
        holder.own = keep

    def _kept(self, page: int, holder: _Holder) -> bool:
        """Brute force: is ``page`` inside the window ending at the page of one of the holder's
        checkpoint positions, or in a periodic checkpoint window?"""
        for c in holder.ends:
            end = c // self.ps
            if end > 0 and window_first_page(end, self.window, self.ps) <= page < end:
                return True
        return is_checkpoint_page(page, self.checkpoint_every, self.window, self.ps)

    def _window_prefixes(self, exclude: _Holder | None = None) -> set[Prefix]:
        """Prefixes of the pages in some running request's last window."""
        out = set()
        for h in self.holders.values():
            if h is exclude:
                continue
            for j in range(window_first_page(len(h.keys), self.window, self.ps), len(h.keys)):
                out.add(tuple(h.keys[:j + 1]))
        return out

    def _is_leaf(self, prefix: Prefix) -> bool:
        n = len(prefix)
        return not any(len(k) == n + 1 and k[:n] == prefix for k in self.entries)

    def _touch(self, keys: list) -> None:
        self._clock += 1
        for j in range(len(keys)):
            self.last_access[tuple(keys[:j + 1])] = self._clock


def radix_state(cache) -> dict[Prefix, tuple[bool, bool]]:
    """The same view as ``NaivePrefixCache.state`` read from an ``SWARadixCache``."""
    out: dict[Prefix, tuple[bool, bool]] = {}
    stack = [(cache.tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for key, s in zip(child.keys, child.swa):
                p = p + (key,)
                out[p] = (True, s >= 0)
            stack.append((child, p))
    return out
