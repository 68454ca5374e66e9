"""A store behind a fixed delay per read: a far disk or a remote Redis, for benchmarks and tests of
how the KV tiers cope with L3 latency (benchmarks/l3_prefetch.py)."""

from __future__ import annotations

import time

from llm_core.storage.kv_store import KeyValueStore


class DelayedStore(KeyValueStore):
    """``inner`` with ``delay_s`` added to every ``get``; writes, deletes and touches pass through."""

    def __init__(self, inner: KeyValueStore, delay_s: float) -> None:
        super().__init__()
        if delay_s < 0:
            raise ValueError(f"DelayedStore.delay_s must be >= 0, got {delay_s}")
        self.inner, self.delay_s = inner, delay_s
        self.name = f"delayed-{inner.name}"

    def get(self, key: str) -> bytes | None:
        time.sleep(self.delay_s)
        return self.inner.get(key)

    def put(self, key: str, value: bytes, *, keep_existing: bool = False) -> bool:
        return self.inner.put(key, value, keep_existing=keep_existing)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def delete_unless_changed(self, key: str, value: bytes) -> bool:
        return self.inner.delete_unless_changed(key, value)

    def touch(self, keys: list[str]) -> int:
        return self.inner.touch(keys)

    def close(self) -> None:
        self.inner.close()

    @property
    def stats(self) -> dict[str, int]:
        return self.inner.stats
