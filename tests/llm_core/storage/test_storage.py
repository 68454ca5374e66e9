"""llm_core.storage: the key → bytes tiers (memory LRU, local directory, Redis) and the
checksummed entry format."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.storage import (
    CorruptEntry,
    DelayedStore,
    KeyValueStore,
    LocalDirStore,
    MemoryStore,
    RedisStore,
    decode_entry,
    encode_entry,
)

keys = st.text(alphabet="abcdef", min_size=1, max_size=3)
values = st.binary(max_size=64)
ops = st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), keys, values), max_size=40)


@pytest.fixture(params=["memory", "disk", "redis", "delayed"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> KeyValueStore:
    if request.param == "memory":
        return MemoryStore(max_bytes=1 << 20)
    if request.param == "delayed":  # reads 1 ms late, otherwise the directory store
        return DelayedStore(LocalDirStore(tmp_path / "store"), delay_s=0.001)
    if request.param == "disk":
        return LocalDirStore(tmp_path / "store")
    port = request.getfixturevalue("redis_server")
    return RedisStore(port=port, prefix=f"t-{uuid.uuid4().hex}:")


# ---- entry format ---------------------------------------------------------------------------

@given(key=st.text(min_size=1, max_size=20), value=st.binary(max_size=200))
def test_entry_round_trip(key: str, value: bytes) -> None:
    assert decode_entry(encode_entry(key, value), key) == value


@given(value=st.binary(min_size=1, max_size=100), data=st.data())
def test_entry_any_byte_flip_or_truncation_is_detected(value: bytes, data: st.DataObject) -> None:
    raw = encode_entry("k", value)
    pos = data.draw(st.integers(0, len(raw) - 1))
    flipped = raw[:pos] + bytes([raw[pos] ^ data.draw(st.integers(1, 255))]) + raw[pos + 1:]
    with pytest.raises(CorruptEntry):
        decode_entry(flipped, "k")
    with pytest.raises(CorruptEntry):
        decode_entry(raw[: data.draw(st.integers(0, len(raw) - 1))], "k")


def test_entry_under_another_key_is_rejected() -> None:
    with pytest.raises(CorruptEntry, match="key"):
        decode_entry(encode_entry("a", b"v"), "b")


# ---- every store ----------------------------------------------------------------------------

def test_store_round_trip_overwrite_delete(store: KeyValueStore) -> None:
    assert store.get("k") is None
    assert store.put("k", b"one")
    assert store.get("k") == b"one"
    assert store.put("k", b"two")
    assert store.get("k") == b"two"
    assert store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.delete("k")
    assert not store.delete("k")
    assert store.get("k") is None
    store.check_integrity()
    assert store.stats["hits"] == 3


def test_delete_unless_changed_removes_only_the_value_read(store: KeyValueStore) -> None:
    """The value a get returned is removed; a value put since (or a missing key) stays as it is."""
    assert store.put("k", b"read")
    assert store.delete_unless_changed("k", b"read") and store.get("k") is None
    assert not store.delete_unless_changed("k", b"read")  # gone: nothing to remove
    assert store.put("k", b"read") and store.put("k", b"saved since")
    assert not store.delete_unless_changed("k", b"read")
    assert store.get("k") == b"saved since"
    with pytest.raises(ValueError):
        store.delete_unless_changed("", b"x")


def test_store_rejects_bad_keys_and_values(store: KeyValueStore) -> None:
    with pytest.raises(ValueError, match="key"):
        store.get("")
    with pytest.raises(ValueError, match="key"):
        store.put("x" * 5000, b"v")
    with pytest.raises(TypeError, match="bytes"):
        store.put("k", "not bytes")  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(sequence=ops)
def test_store_matches_a_dict_model(sequence: list[tuple[str, str, bytes]], tmp_path_factory) -> None:
    stores = [MemoryStore(1 << 20), LocalDirStore(tmp_path_factory.mktemp("model"))]
    for s in stores:
        model: dict[str, bytes] = {}
        for op, key, value in sequence:
            if op == "put":
                assert s.put(key, value)
                model[key] = value
            elif op == "get":
                assert s.get(key) == model.get(key)
            else:
                assert s.delete(key) == (model.pop(key, None) is not None)
            s.check_integrity()
        assert all(s.get(k) == v for k, v in model.items())


# ---- memory LRU -----------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(sequence=st.lists(st.tuples(keys, st.integers(0, 40)), max_size=60), budget=st.integers(0, 100))
def test_memory_lru_budget_invariants(sequence: list[tuple[str, int]], budget: int) -> None:
    s = MemoryStore(max_bytes=budget)
    latest: dict[str, bytes] = {}
    for i, (key, size) in enumerate(sequence):
        value = bytes([i % 256]) * size
        stored = s.put(key, value)
        assert stored == (size <= budget)
        if stored:
            latest[key] = value
            assert s.keys()[-1] == key  # most recent put is MRU and survives its own eviction pass
        else:
            latest.pop(key, None)  # a rejected put also dropped the old value
            s.delete(key)
        s.check_integrity()
        for k in s.keys():
            assert s.get(k) == latest[k]  # evicted or not, never a stale value


def test_memory_lru_evicts_least_recently_used() -> None:
    s = MemoryStore(max_bytes=30)
    for k in "abc":
        s.put(k, b"x" * 10)
    s.get("a")  # a becomes MRU → b is the LRU victim
    s.put("d", b"y" * 10)
    assert s.keys() == ["c", "a", "d"]
    assert s.stats["evictions"] == 1
    assert not s.put("huge", b"z" * 31)
    assert len(s) == 3


# ---- local directory ------------------------------------------------------------------------

def _entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/*.entry"))


def test_disk_entries_survive_a_new_instance(tmp_path: Path) -> None:
    LocalDirStore(tmp_path).put("persist", b"payload")
    again = LocalDirStore(tmp_path)
    assert again.get("persist") == b"payload"
    assert len(again) == 1
    again.check_integrity()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_disk_damaged_entry_is_a_miss_and_removed(tmp_path: Path, damage: str) -> None:
    s = LocalDirStore(tmp_path)
    s.put("k", b"v" * 100)
    (path,) = _entry_files(tmp_path)
    raw = path.read_bytes()
    damaged = {
        "flip": raw[:-1] + bytes([raw[-1] ^ 1]),
        "truncate": raw[: len(raw) // 2],
        "empty": b"",
        "foreign": encode_entry("other-key", b"v" * 100),  # a name collision can never alias
    }[damage]
    path.write_bytes(damaged)
    fresh = LocalDirStore(tmp_path)
    assert fresh.get("k") is None
    assert not path.exists()
    assert fresh.stats["corrupt"] == 1
    fresh.check_integrity()


def test_disk_startup_removes_dead_temp_files_and_budget_evicts_lru(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, max_bytes=3 * 200)
    for i, k in enumerate("abc"):
        s.put(k, bytes(100))
        t = time.time() - 100 + i  # distinct mtimes: a < b < c
        os.utime(s._path(k), (t, t))
    (tmp_path / "00").mkdir(exist_ok=True)
    dead, live = tmp_path / "00" / ".tmp-dead", tmp_path / "00" / ".tmp-live"
    dead.write_bytes(b"half a write")
    old = time.time() - 2 * 3600
    os.utime(dead, (old, old))
    live.write_bytes(b"another process writing now")
    s = LocalDirStore(tmp_path, max_bytes=3 * 200)  # restart: recency from mtimes
    assert not dead.exists() and live.exists()  # a fresh temp file may be a live write elsewhere
    live.unlink()
    s.check_integrity()
    assert s.get("a") == bytes(100)  # a becomes MRU → b is the LRU victim
    s.put("d", bytes(100))
    assert s.get("b") is None and s.get("a") is not None and s.get("c") is not None
    s.check_integrity()


def test_disk_concurrent_writers_leave_one_intact_value(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    values = [bytes([i]) * 5000 for i in range(8)]
    threads = [threading.Thread(target=lambda v=v: [s.put("same", v) for _ in range(10)]) for v in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.get("same") in values
    s.check_integrity()


# ---- touch (the L3 keep-alive) and the directory store's cap ---------------------------------

def test_touch_counts_present_keys_and_keeps_them_from_eviction(store: KeyValueStore) -> None:
    for k in "abc":
        assert store.put(k, b"v" * 10)
    assert store.touch(["a", "c", "missing"]) == 2
    assert store.touch([]) == 0
    assert store.get("a") == b"v" * 10
    with pytest.raises(ValueError):
        store.touch(["a", ""])


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_touched_entries_are_evicted_last(kind: str, tmp_path: Path) -> None:
    entry = len(encode_entry("k0", bytes(100)))
    s = MemoryStore(4 * 100) if kind == "memory" else LocalDirStore(tmp_path, max_bytes=4 * entry)
    for i in range(4):
        s.put(f"k{i}", bytes(100))
    assert s.touch(["k0", "k1"]) == 2  # k2, k3 are now the least recently used
    s.put("k4", bytes(100))
    s.put("k5", bytes(100))
    assert [s.get(f"k{i}") is not None for i in range(6)] == [True, True, False, False, True, True]
    s.check_integrity()


def test_disk_cap_holds_under_many_puts_and_restart_keeps_the_lru_order(tmp_path: Path) -> None:
    entry = len(encode_entry("k00", bytes(300)))
    s = LocalDirStore(tmp_path, max_bytes=5 * entry)
    for i in range(20):
        s.put(f"k{i:02d}", bytes(300))
        assert s.nbytes <= 5 * entry
        t = time.time() - 100 + i  # distinct access times, oldest first
        os.utime(s._path(f"k{i:02d}"), (t, t))
    assert len(s) == 5 and s.stats["evictions"] == 15
    assert s.touch(["k15"]) == 1  # k15 becomes the most recent (its mtime is now)
    s.check_integrity()
    again = LocalDirStore(tmp_path, max_bytes=5 * entry)  # the index rebuilt from the directory
    assert (len(again), again.nbytes) == (5, 5 * entry)
    again.check_integrity()
    again.put("new", bytes(300))  # evicts the oldest by access time: k16, not the touched k15
    assert again.get("k16") is None and again.get("k15") is not None and again.get("k17") is not None
    # reopened with a smaller cap: trimmed at once, oldest first
    for i, k in enumerate(["k17", "new", "k15", "k18", "k19"]):
        t = time.time() - 50 + i
        os.utime(again._path(k), (t, t))
    small = LocalDirStore(tmp_path, max_bytes=2 * entry)
    assert len(small) == 2 and small.get("k18") is not None and small.get("k19") is not None
    small.check_integrity()


def test_redis_touch_renews_the_ttl_of_every_key_in_one_call(redis_server: int) -> None:
    import redis

    s = RedisStore(port=redis_server, prefix=f"t-{uuid.uuid4().hex}:", ttl_s=100)
    raw = redis.Redis(port=redis_server)
    for k in "abc":
        s.put(k, b"x")
        raw.expire(s.prefix + k, 5)  # about to expire
    assert s.touch(["a", "b", "c", "gone"]) == 3
    assert all(raw.ttl(s.prefix + k) > 50 for k in "abc")
    s.close()
    raw.close()


def test_keep_existing_never_replaces_a_stored_value(store: KeyValueStore) -> None:
    assert store.put("page", b"with its window", keep_existing=True)  # absent: stored
    assert store.put("page", b"without", keep_existing=True)  # present: kept
    assert store.get("page") == b"with its window"
    assert store.stats.get("kept") == 1
    assert store.put("page", b"replaced")  # a plain put still replaces
    assert store.get("page") == b"replaced"


def _store_with_a_damaged_page(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> KeyValueStore:
    """A store of ``kind`` whose entry "page" does not read back whole (a flipped bit on disk,
    bytes that are no entry in Redis)."""
    if kind == "disk":
        store = LocalDirStore(tmp_path)
        store.put("page", b"old")
        (path,) = _entry_files(tmp_path)
        raw = path.read_bytes()
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
        return store
    import redis

    port = request.getfixturevalue("redis_server")
    store = RedisStore(port=port, prefix=f"t-{uuid.uuid4().hex}:")
    client = redis.Redis(port=port)
    client.set(store.prefix + "page", b"garbage")
    client.close()
    return store


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_keep_existing_replaces_a_damaged_value(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A KV chain read stops at its first missing page, so a damaged page further down is never read
    (and removed) by a ``get``: the next ``keep_existing`` put of that page is where it must go, or
    the page misses for good."""
    store = _store_with_a_damaged_page(kind, tmp_path, request)
    assert store.put("page", b"without", keep_existing=True)
    assert store.get("page") == b"without"
    assert store.stats["corrupt"] == 1 and store.stats.get("kept", 0) == 0
    assert store.put("page", b"other", keep_existing=True)  # whole now: kept
    assert store.get("page") == b"without" and store.stats["kept"] == 1
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_get_spares_the_value_a_put_stored_after_it_read_a_damaged_one(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch) -> None:
    """A put replaces a damaged value between a ``get``'s read and its verdict (the KV writer saving
    the page a fetch found damaged). The get used to remove the key's entry -- the new one, lost
    although the put had returned True -- and missed; it now returns the new value, which stays."""
    from llm_core.storage import local_dir_store, redis_store

    store = _store_with_a_damaged_page(kind, tmp_path, request)
    module = local_dir_store if kind == "disk" else redis_store
    real, crossed = module.decode_entry, []

    def decode(raw: bytes, key: str) -> bytes:
        if not crossed:  # the get has the damaged bytes: the put lands now
            crossed.append(True)
            assert store.put("page", b"new", keep_existing=True)  # replaces the damaged one
        return real(raw, key)

    monkeypatch.setattr(module, "decode_entry", decode)
    assert store.get("page") == b"new"
    monkeypatch.setattr(module, "decode_entry", real)
    assert store.get("page") == b"new"
    assert store.stats["corrupt"] == 2 and store.stats["hits"] == 2  # the put's check and the get's
    store.check_integrity()
    store.close()


def test_disk_a_root_deleted_while_running_is_made_again(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path / "kv", max_bytes=1 << 20)
    assert s.put("old", b"v" * 100)
    shutil.rmtree(tmp_path / "kv")  # an operator cleaning the cache dir under a running server
    assert s.get("old") is None
    assert s.put("new", b"w" * 100)
    assert s.get("new") == b"w" * 100
    assert len(s) == 1 and s.nbytes == len(encode_entry("new", b"w" * 100))  # the lost entries forgotten
    s.check_integrity()


def test_disk_a_damaged_entry_on_a_read_only_filesystem_is_a_miss(tmp_path: Path, monkeypatch) -> None:
    """The store cannot remove (nor write) anything: a damaged entry still reads as a miss, and every
    call returns -- the KeyValueStore contract says a store never raises."""
    s = LocalDirStore(tmp_path)
    s.put("k", b"v" * 100)
    (path,) = _entry_files(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(os, "replace", read_only)
    assert s.get("k") is None
    assert s.stats["corrupt"] == 1 and s.stats["errors"] == 1
    assert path.exists()
    assert not s.put("k", b"v" * 100, keep_existing=True)  # counted dropped, not raised
    assert not s.put("other", b"x")
    assert not s.delete("k")
    assert s.get("k") is None
