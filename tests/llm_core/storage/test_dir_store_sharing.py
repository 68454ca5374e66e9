"""LocalDirStore under concurrency: processes sharing one directory (replicas on one node) keep its
cap and each other's writes in progress; a read racing an eviction leaves the index exact."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from llm_core.storage import LocalDirStore, encode_entry


def test_disk_processes_sharing_a_directory_keep_its_cap(tmp_path: Path) -> None:
    """Two stores on one directory (replicas on one node): each rescans after writing an eighth of
    the cap, so the directory stays within the cap plus what one wrote since its last rescan."""
    entry = len(encode_entry("a0", bytes(1000)))
    cap = 40 * entry
    a, b = LocalDirStore(tmp_path, max_bytes=cap), LocalDirStore(tmp_path, max_bytes=cap)
    for i in range(200):
        a.put(f"a{i}", bytes(1000))
        b.put(f"b{i}", bytes(1000))
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("??/*.entry"))
        assert on_disk <= cap + cap // 8 + entry, (i, on_disk)
    # the latest writes of both survive; a rescan forgets what the other one evicted
    a._rescan()
    assert all(p.exists() for p in a._index)
    assert a.get("a199") is not None and b.get("b199") is not None


def test_disk_a_starting_process_keeps_another_ones_writes(tmp_path: Path) -> None:
    a = LocalDirStore(tmp_path)
    stop = threading.Event()
    failures = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            if not a.put(f"p{i % 20}", bytes(1 << 20)):
                failures.append(i)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            LocalDirStore(tmp_path)  # another process starting on the directory
    finally:
        stop.set()
        t.join(10)
    assert failures == [] and a.stats.get("errors", 0) == 0


def test_disk_a_read_racing_an_eviction_leaves_no_phantom_entry(tmp_path: Path, monkeypatch) -> None:
    """The writer thread evicts (unlinks) a file between a reader's read and its recency update:
    the index must not list the file again."""
    from llm_core.storage import local_dir_store

    s = LocalDirStore(tmp_path, max_bytes=10_000)
    s.put("k", bytes(100))
    real_decode = local_dir_store.decode_entry

    def read_then_evicted(raw: bytes, key: str) -> bytes:  # the store checks the bytes it has read
        s.delete("k")  # what an eviction on another thread does meanwhile
        return real_decode(raw, key)

    monkeypatch.setattr(local_dir_store, "decode_entry", read_then_evicted)
    assert s.get("k") == bytes(100)  # the bytes read are still a valid answer
    assert len(s) == 0 and s.nbytes == 0
    s.check_integrity()
