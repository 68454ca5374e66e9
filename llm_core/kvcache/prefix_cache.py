"""The prefix-cache interface the scheduler drives, and the cache that caches nothing.

Per request the scheduler calls ``prefetch`` until it says the request may be matched, ``match`` once
when it admits a page-less request, ``on_computed``
after every step it ran in, and ``release`` when it finishes or is preempted; ``make_room`` comes
before an allocation would fail. ``SWARadixCache`` (swa_radix_cache.py) is the real implementation,
``tests/oracles/naive_prefix_cache.py`` a brute-force one for tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from llm_core.engine.request import Request
from llm_core.kvcache.dual_pool import DualKVPool


class PrefixCache(ABC):
    """Seam for a prefix cache (an SWA-aware radix tree plugs in here).

    Contract: ``match`` may fill a page-less request's ``full_pages`` / ``swa_pages`` for its first
    ``k`` tokens (holding a reference on each page through the pool allocators; SWA pages more than a
    window behind ``k`` may be -1) and must leave at least one token uncomputed; it returns ``k``.
    ``on_computed`` sees a request after each step (to insert new full pages); ``release`` gets a
    finished or preempted request and must drop the request's references (or keep them as tree pages).
    """

    @abstractmethod
    def match(self, request: Request, pool: DualKVPool) -> int: ...

    @abstractmethod
    def on_computed(self, request: Request, pool: DualKVPool) -> None: ...

    @abstractmethod
    def release(self, request: Request, pool: DualKVPool) -> None: ...

    def admitted(self, request: Request) -> None:
        """``request`` was scheduled with the prefix its last ``match`` gave (its
        ``num_cached_tokens``): the lookup counts now. A request matched and given back because it
        cannot run yet (embeddings not arrived, no room) is matched again every step it waits, and
        those lookups must not count as queries or hits."""
        return None

    def make_room(self, pool: DualKVPool, full_pages: int, swa_pages: int) -> None:
        """An allocation is short by this many pages: evict cached pages (before anyone is preempted)."""
        return None

    def prefetch(self, request: Request) -> bool:
        """Before ``match`` of a page-less request: start loading what slow tiers (L3) hold of its
        prefix, off the engine thread. False while the request should wait for that load (it is not
        scheduled; others are); True when ``match`` may run now."""
        return True

    def peek(self, request: Request) -> int:
        """Tokens ``match`` would supply now, without taking anything (for queue ordering)."""
        return 0

    def kv_buffers(self, pool: DualKVPool):
        """What the model reads KV through this step: the pool, or a view whose ``layer(i)`` waits
        until tier loads of layer i have landed."""
        return pool

    def stats(self) -> dict[str, int]:
        return {}

    def clear(self) -> None:
        """Drop every cached page (no request may hold any); the pools are then as without a cache."""
        return None

    def close(self) -> None:
        """Stop background work (tier writers); the cache must not be used afterwards."""
        return None


class NoPrefixCache(PrefixCache):
    """Caches nothing: every page is freed when its request lets go of it."""

    def match(self, request: Request, pool: DualKVPool) -> int:
        return 0

    def on_computed(self, request: Request, pool: DualKVPool) -> None:
        return None

    def release(self, request: Request, pool: DualKVPool) -> None:
        pool.full.free(request.full_pages)
        pool.swa.free(request.swa_pages)
