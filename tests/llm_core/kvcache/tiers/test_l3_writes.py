"""L3 writes: the keep-alive touching a matched chain in one batched call; a page counts as written
only once the store kept it (a dropped or lost one is written again), the write queue's byte bound,
a close that a hung store cannot hold up, and a page's save landing while a fetch reads its damaged
copy (the new copy stays and is used). The harness and the tiers it runs over are
test_kv_tiers.py's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.tiers.tier_threads import KVTierThreads
from llm_core.storage import DelayedStore, KeyValueStore, LocalDirStore, MemoryStore, RedisStore
from llm_core.storage import local_dir_store, redis_store
from tests.llm_core.kvcache.test_swa_radix_cache import BASES
from tests.llm_core.kvcache.tiers.test_kv_tiers import LAYOUT, harness, replay, tiers


class TouchLog(MemoryStore):
    """A MemoryStore that records every batched ``touch``."""

    def __init__(self) -> None:
        super().__init__(1 << 24)
        self.calls: list[list[str]] = []

    def touch(self, keys: list[str]) -> int:
        self.calls.append(list(keys))
        return super().touch(keys)


def test_keep_alive_touches_every_page_of_the_matched_chain_in_one_call():
    from llm_core.kvcache.tiers.page_format import store_key

    store = TouchLog()
    h = harness(tiers(None, store), full_pages=40, swa_pages=24)
    first, again = replay(h, [BASES[0][:30], BASES[0][:30]])
    assert again.num_cached_tokens >= 20
    h.cache.tiers.flush()  # the writer thread has run every queued touch
    chain = [store_key(x) for x in h.cache.tiers.page_hashes(again, again.num_cached_tokens // 2)]
    assert chain in store.calls  # the whole chain, the first page included, in one batch
    assert h.cache.stats()["l3_touched_pages"] >= len(chain)
    h.cache.close()


# a page counts as written only once kept; a bounded queue; a bounded close
class Refusing(MemoryStore):
    """A MemoryStore that drops every put while ``refuse`` is set (Redis down or at maxmemory)."""

    def __init__(self) -> None:
        super().__init__(1 << 24)
        self.refuse = False

    def put(self, key: str, value: bytes, **kw) -> bool:
        if self.refuse:
            self._count("dropped")
            return False
        return super().put(key, value, **kw)


@pytest.mark.parametrize("how", ["the store drops it", "the write queue is full"])
def test_a_dropped_l3_write_is_written_at_the_pages_next_eviction(how):
    store = Refusing()
    h = harness(tiers(None, store), full_pages=40, swa_pages=24)
    replay(h, [BASES[0][:30]])
    t = h.cache.tiers
    if how == "the store drops it":
        store.refuse = True
    else:
        t.threads.write_queue_bytes = 0
    h.cache.evict(0, 2)  # tombstones a node's SWA: its pages are saved (Full + SWA) first
    t.flush()
    stats = h.cache.stats()
    assert stats["pages_saved"] > 0 and store.keys() == []
    assert stats.get("l3_puts", 0) == 0  # only puts the store kept count
    counted = "l3_puts_failed" if how == "the store drops it" else "l3_puts_dropped"
    assert stats.get(counted, 0) == stats["pages_saved"]
    store.refuse, t.threads.write_queue_bytes = False, 1 << 20
    h.cache.clear()  # now the Full pages go: the dropped ones are not believed to be in L3
    t.flush()
    assert len(store.keys()) == h.cache.stats()["l3_puts"] == 16  # every page of the 30-token prompt + output
    h.cache.close()


def test_a_page_l3_lost_is_written_again_after_a_match_misses_it():
    from llm_core.kvcache.tiers.page_format import store_key

    store = MemoryStore(1 << 24)
    h = harness(tiers(None, store), full_pages=40, swa_pages=24)
    first = replay(h, [BASES[0][:30]])[0]
    h.cache.clear()
    h.cache.tiers.flush()
    chain = {store_key(x) for x in h.cache.tiers.page_hashes(first, 14)}  # the pages a match looks up
    assert chain <= set(store.keys())
    for key in store.keys():  # Redis restarted, flushed, or aged the pages out
        store.delete(key)
    again = replay(h, [BASES[0][:30]])[0]
    assert again.num_cached_tokens == 0
    h.cache.clear()  # the match missed them: written again, not taken for still in L3
    h.cache.tiers.flush()
    assert chain <= set(store.keys())
    h.cache.close()


class Hung(MemoryStore):
    """A MemoryStore whose puts wait for ``gate``: a store slower than eviction, or a hung one."""

    def __init__(self) -> None:
        super().__init__(1 << 24)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put(self, key: str, value: bytes, **kw) -> bool:
        self.entered.set()
        self.gate.wait()
        return super().put(key, value, **kw)


def test_the_l3_write_queue_is_bounded_in_bytes_and_close_does_not_wait_for_a_hung_store(caplog):
    pool = DualKVPool(LAYOUT, num_full_tokens=16, num_swa_tokens=16, page_size=2)
    store, written = Hung(), []
    threads = KVTierThreads(pool, store, on_written=lambda h, with_swa: written.append(h),
                            write_queue_bytes=1000, close_timeout_s=0.3)
    row = torch.zeros(100)  # 400 bytes
    started = time.monotonic()
    queued = [threads.put(bytes([i]), row, None) for i in range(5)]
    assert time.monotonic() - started < 0.5  # the engine thread never waits for the store
    assert queued == [True, True, False, False, False]  # the third would take the queue past 1000 bytes
    assert not threads.touch([bytes(32)] * 8)  # 256 bytes more do not fit either
    stats = threads.stats()
    assert (stats["l3_puts_dropped"], stats["l3_touches_dropped"], stats["l3_write_queue_bytes"]) == (3, 1, 800)
    assert store.entered.wait(5) and not threads.join_writes(0.05)  # the writer is stuck in the first put
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="llm_core.kvcache.tiers.tier_threads"):
        threads.stop()  # the first put hangs in the store; the second is abandoned
    assert time.monotonic() - started < 3
    assert threads.stats()["l3_writes_abandoned"] == 1 and "abandoned 1" in caplog.text
    assert written == [] and threads.stats().get("l3_puts", 0) == 0
    store.gate.set()  # lets the stuck writer thread finish (it is a daemon either way)


def test_the_writer_reports_only_puts_the_store_kept():
    pool = DualKVPool(LAYOUT, num_full_tokens=16, num_swa_tokens=16, page_size=2)
    store, written = Refusing(), []
    threads = KVTierThreads(pool, store, on_written=lambda h, with_swa: written.append((h, with_swa)))
    row = torch.zeros(10)
    threads.put(b"a", row, row)
    threads.join_writes()
    store.refuse = True
    threads.put(b"b", row, None)
    threads.join_writes()
    assert written == [(b"a", True)]
    stats = threads.stats()
    assert (stats["l3_puts"], stats["l3_puts_failed"], stats["l3_write_queue_bytes"]) == (1, 1, 0)
    threads.stop()


# a read of a damaged page crossing that page's queued save
class SaveCrossesRead(DelayedStore):
    """``inner`` whose put of ``target`` waits (``entered``) until a read of ``target``'s damaged
    entry has its bytes (``read``), then sets ``written``; with ``gate_decode`` that read waits for
    ``written`` before it checks them: the save lands between a read and its verdict."""

    def __init__(self, inner: KeyValueStore) -> None:
        super().__init__(inner, 0.0)
        self.target: str | None = None
        self.entered, self.read, self.written = threading.Event(), threading.Event(), threading.Event()
        self.keys: list[str] = []  # every put, in order

    def put(self, key: str, value: bytes, *, keep_existing: bool = False) -> bool:
        self.keys.append(key)
        if key != self.target:
            return super().put(key, value, keep_existing=keep_existing)
        self.entered.set()
        assert self.read.wait(10)
        try:
            return super().put(key, value, keep_existing=keep_existing)
        finally:
            self.written.set()

    def gate_decode(self, module, monkeypatch) -> None:
        real = module.decode_entry

        def decode(raw: bytes, key: str) -> bytes:
            if key == self.target and self.entered.is_set() and not self.read.is_set():  # the fetch's read
                self.read.set()
                assert self.written.wait(10)
            return real(raw, key)

        monkeypatch.setattr(module, "decode_entry", decode)


@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_a_fetch_of_a_damaged_page_keeps_the_copy_its_queued_save_wrote_meanwhile(kind, tmp_path, request,
                                                                                  monkeypatch):
    """L3 entries damaged; a request recomputes the prompt and its pages' saves queue up; the next
    request's chain read gets a damaged page's bytes just before that page's save replaces it. The
    store used to remove the damaged entry by name once the bytes failed their check -- the new one:
    that request missed from there although the good copy was in L3, and so did every other engine
    on the store (and this one after a restart; the writer had counted the page written)."""
    from llm_core.kvcache.tiers.page_format import store_key

    prompt = BASES[0][:30]
    if kind == "dir":
        module, open_store = local_dir_store, lambda: LocalDirStore(tmp_path)  # noqa: E731
    else:
        import redis

        port, prefix = request.getfixturevalue("redis_server"), f"cross-{tmp_path.name}:"
        module, open_store = redis_store, lambda: RedisStore(port=port, prefix=prefix)  # noqa: E731
    first = harness(tiers(None, open_store()))
    replay(first, [prompt])
    first.cache.close()  # writes the tree down
    healthy = harness(tiers(None, open_store()))
    want = replay(healthy, [prompt])[0].num_cached_tokens
    healthy.cache.close()
    if kind == "dir":
        for f in tmp_path.glob("??/*.entry"):
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 1
            f.write_bytes(bytes(data))
    else:
        client = redis.Redis(port=port)
        for key in client.keys(prefix + "*"):
            client.set(key, b"garbage")
        client.close()
    store = SaveCrossesRead(open_store())
    h = harness(tiers(None, store))
    r1 = replay(h, [prompt])[0]
    assert r1.num_cached_tokens == 0
    h.cache.tiers.flush()
    chain = [store_key(x) for x in h.cache.tiers.page_hashes(r1, want // 2)]
    j = next(i for i, k in enumerate(chain) if k not in store.keys)  # the first page still damaged in L3
    assert j > 0
    store.target = chain[j]
    store.gate_decode(module, monkeypatch)
    h.cache.clear()  # saves every page: the writer stops in page j's put until a fetch has its bytes
    assert store.entered.wait(10)
    r2 = replay(h, [prompt])[0]
    assert store.written.is_set()
    assert r2.num_cached_tokens >= (j + 1) * 2  # page j came from its new copy (it stopped before j)
    h.cache.tiers.flush()
    replica = harness(tiers(None, open_store()))  # another engine on the store
    assert replay(replica, [prompt])[0].num_cached_tokens == want  # it lost page j
    replica.cache.close()
    h.cache.close()
