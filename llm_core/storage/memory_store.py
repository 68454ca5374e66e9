"""In-process LRU store with a byte budget (the top cache tier)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from llm_core.storage.kv_store import KeyValueStore


class MemoryStore(KeyValueStore):
    """LRU over values; evicts least recently used entries until the new value fits.

    Invariant: ``_bytes == sum(len(v) for v in _items.values()) <= max_bytes``.  A value larger
    than the whole budget is dropped (``put`` returns ``False``) rather than emptying the cache.
    Process memory is trusted, so values are stored raw, without the checksummed envelope."""

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        if max_bytes < 0:
            raise ValueError(f"MemoryStore.max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        self._check_key(key)
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
        self._count("hits" if value is not None else "misses")
        return value

    def put(self, key: str, value: bytes, *, keep_existing: bool = False) -> bool:
        self._check_key(key)
        self._check_value(value)
        if keep_existing:
            with self._lock:
                kept = key in self._items
                if kept:
                    self._items.move_to_end(key)
            if kept:
                self._count("kept")
                return True
        value = bytes(value)
        if len(value) > self.max_bytes:
            self._count("dropped")
            return False
        evicted = 0
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            while self._bytes + len(value) > self.max_bytes:
                _, victim = self._items.popitem(last=False)
                self._bytes -= len(victim)
                evicted += 1
            self._items[key] = value
            self._bytes += len(value)
        self._count("puts")
        self._count("evictions", evicted)
        return True

    def touch(self, keys: list[str]) -> int:
        for key in keys:
            self._check_key(key)
        with self._lock:
            present = [k for k in keys if k in self._items]
            for k in present:
                self._items.move_to_end(k)
        return len(present)

    def delete(self, key: str) -> bool:
        self._check_key(key)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
        return old is not None

    def delete_unless_changed(self, key: str, value: bytes) -> bool:
        self._check_key(key)
        with self._lock:
            old = self._items.get(key)
            if old is None or old != value:
                return False
            del self._items[key]
            self._bytes -= len(old)
        return True

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._items)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(len(v) for v in self._items.values())
            assert total == self._bytes, f"byte count {self._bytes} != sum of values {total}"
            assert self._bytes <= self.max_bytes, f"{self._bytes} bytes over budget {self.max_bytes}"
