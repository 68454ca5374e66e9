"""The store interface every cache tier implements."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter

MAX_KEY_CHARS = 1024


class KeyValueStore(ABC):
    """A key → bytes store.  Thread-safe.  ``get`` returns ``None`` for a missing, damaged or
    unreachable entry (a damaged entry is removed -- that entry, not a value a put stored since it was
    read: that one is returned); ``put`` may drop a value (budget, backend down)
    — a cache tier is allowed to forget, never to return wrong bytes."""

    name: str = "store"

    def __init__(self) -> None:
        self._counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()

    # ---- public API -------------------------------------------------------------------------

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or ``None``."""

    @abstractmethod
    def put(self, key: str, value: bytes, *, keep_existing: bool = False) -> bool:
        """Store ``value`` under ``key`` (replacing any old value); ``False`` when it was dropped.
        With ``keep_existing`` a key that already holds a value that reads back whole keeps it
        (counted ``kept``, and ``True``: the key holds a value for it) -- for values fixed by their
        key where the one stored may carry more, e.g. a KV page with its SWA row against one
        without; a damaged value there is replaced, as without ``keep_existing``."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; ``True`` when something was removed."""

    @abstractmethod
    def delete_unless_changed(self, key: str, value: bytes) -> bool:
        """Remove ``key`` only while it still holds ``value`` (what a ``get`` of it just returned);
        ``True`` when it was removed. A reader that finds a value it cannot use (an L3 page of
        another model) removes it so that the next save replaces it; a put may land between that
        read and the removal (this process's writer, another process sharing the store), and
        removing by name would then drop the new, good value."""

    def touch(self, keys: list[str]) -> int:
        """Refresh the recency (and any expiry) of every key in one batched call, so the store
        ages them out last; returns how many exist. This default reads each value back; stores
        override it with a cheaper batch."""
        return sum(self.get(k) is not None for k in keys)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` when internal bookkeeping is inconsistent."""

    def close(self) -> None:
        """Release backend resources; the store must not be used afterwards."""

    @property
    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, puts, dropped, corrupt, errors, evictions (store-specific)."""
        with self._counter_lock:
            return dict(self._counters)

    # ---- internal helpers -------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self._counters[name] += n

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
            raise ValueError(f"store key must be a non-empty str of at most {MAX_KEY_CHARS} chars, "
                             f"got {key!r:.100}")

    @staticmethod
    def _check_value(value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"store value must be bytes, got {type(value).__name__}")
