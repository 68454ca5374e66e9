"""Entries as files in a local directory: the default persistent cache tier.

    root/
      3f/3fa9…c1.entry        one checksummed entry per key; name = blake3(key) hex,
      a0/a07b…9e.entry        sharded by its first two hex digits
      3f/.tmp-<random>        a write in progress (removed at startup if a process died mid-write)

Writes go to a temp file in the target directory and are moved into place with ``os.replace``,
which is atomic: a reader sees the old entry, the new one, or none — never half of one.  With
``fsync=True`` the data is flushed before the rename, so entries also survive power loss.  Damaged
or truncated files (disk errors, a crash without fsync) fail the checksum, read as a miss and are
deleted (on a read-only filesystem, where they cannot be, they still read as a miss) -- the file read,
not the name: an entry a put wrote meanwhile is read instead.  A put with
``keep_existing`` keeps only an entry that reads back whole: a damaged one is replaced.  A root
deleted while the store runs is made again by the next put.  With ``max_bytes`` the least recently
used files are evicted: every read and ``touch`` moves an entry to the back of the index and sets its
file's mtime, so at startup the index is rebuilt from the directory in the same order (recency
survives a restart).

Several processes may share one directory (replicas on one node, a restarted server beside a
draining one). Each keeps its own index, so with ``max_bytes`` each rescans the directory after
writing an eighth of the cap: the cap then holds for the directory, give or take what the others
wrote since their last rescan. A starting process removes only temp files older than an hour -- a
live write takes seconds, and deleting another process's would fail its ``put``.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

import blake3

from llm_core.storage.entry_codec import CorruptEntry, decode_entry, encode_entry
from llm_core.storage.kv_store import KeyValueStore

_SUFFIX = ".entry"
_TMP_PREFIX = ".tmp-"
_DEAD_TMP_AGE_S = 3600.0
_RESCAN_FRACTION = 8  # rescan after writing max_bytes / this


class LocalDirStore(KeyValueStore):
    """Invariant: ``_index`` maps every entry file this process knows to its size, in LRU order,
    and ``_bytes == sum(_index.values()) <= max_bytes`` (when set) after every ``put``. Renames,
    evictions and index updates happen under one lock, so (within this process) the index never
    lists a file that is gone."""

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], max_bytes: int | None = None,
                 fsync: bool = False) -> None:
        super().__init__()
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"LocalDirStore.max_bytes must be >= 0 or None, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[Path, int] = OrderedDict()
        self._bytes = 0
        self._written_since_scan = 0
        self._remove_dead_temp_files()
        with self._lock:
            self._rescan()
            victims = self._evict()  # reopened with a smaller cap: trim now, oldest first
        self._count("evictions", len(victims))

    # ---- public API -------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        self._check_key(key)
        found = self._read_whole(self._path(key), key)
        self._count("hits" if found is not None else "misses")
        return found

    def put(self, key: str, value: bytes, *, keep_existing: bool = False) -> bool:
        self._check_key(key)
        self._check_value(value)
        path = self._path(key)
        if keep_existing and self._keep(path, key):
            return True
        raw = encode_entry(key, bytes(value))
        if self.max_bytes is not None and len(raw) > self.max_bytes:
            self._count("dropped")
            return False
        kept = False
        try:
            fd, tmp = self._temp_file(path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(raw)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                with self._lock:
                    # written meanwhile by this process or another (a process sharing the directory
                    # could still land between this check and the rename: a rare, harmless overwrite)
                    kept = keep_existing and path.exists()
                    if not kept:
                        os.replace(tmp, path)
                        self._bytes += len(raw) - self._index.pop(path, 0)
                        self._index[path] = len(raw)
                        self._written_since_scan += len(raw)
                        if self._rescan_due():
                            self._rescan()
                        victims = self._evict()
                if kept:
                    Path(tmp).unlink(missing_ok=True)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            self._count("errors")
            self._count("dropped")
            return False
        if kept:
            return self._keep(path, key) or self.put(key, value, keep_existing=True)
        self._count("puts")
        self._count("evictions", len(victims))
        return True

    def touch(self, keys: list[str]) -> int:
        """Mark ``keys`` used now (index order and file mtime) without reading them."""
        found = 0
        for key in keys:
            self._check_key(key)
            path = self._path(key)
            try:
                size = path.stat().st_size
            except OSError:
                self._forget(path)
                continue
            self._touch(path, size)
            found += 1
        return found

    def delete(self, key: str) -> bool:
        self._check_key(key)
        return self._remove(self._path(key))

    def delete_unless_changed(self, key: str, value: bytes) -> bool:
        """The file is read, compared and, while ``_path(key)`` still names that file (its inode),
        removed under this process's rename lock: a put's rename in between keeps the new entry. A
        process sharing the directory could still land between the check and the unlink: rare, and
        its entry is lost from L3, never served wrong."""
        self._check_key(key)
        path = self._path(key)
        opened = self._open_entry(path, key)
        if opened is None:
            return False
        f, now, _ = opened
        with f:  # held open until the removal: the file's inode cannot be reused meanwhile
            return now == value and not self._remove_unless_replaced(path, os.fstat(f.fileno()))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def check_integrity(self) -> None:
        """Call when no write is in flight (a write's temp file is briefly visible)."""
        with self._lock:
            assert self._bytes == sum(self._index.values()), "byte count drifted from the index"
            if self.max_bytes is not None:
                assert self._bytes <= self.max_bytes, f"{self._bytes} bytes over {self.max_bytes}"
            on_disk = {p: p.stat().st_size for p in self.root.glob(f"??/*{_SUFFIX}")}
            assert on_disk == dict(self._index), "index and directory disagree"
            assert not list(self.root.glob(f"??/{_TMP_PREFIX}*")), "temp files left behind"

    # ---- internal helpers -------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        digest = blake3.blake3(key.encode()).hexdigest()
        return self.root / digest[:2] / f"{digest}{_SUFFIX}"

    def _remove_dead_temp_files(self) -> None:
        """Temp files of writes that died with their process; a recent one may be another live
        process's write in progress."""
        cutoff = time.time() - _DEAD_TMP_AGE_S
        for tmp in self.root.glob(f"??/{_TMP_PREFIX}*"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def _rescan_due(self) -> bool:
        return self.max_bytes is not None and self._written_since_scan * _RESCAN_FRACTION >= self.max_bytes

    def _rescan(self) -> None:
        """Refresh the index from the directory (caller holds the lock): files gone are forgotten,
        files this process did not know (another process's writes, or all of them at startup) join
        as most recently used, oldest mtime first. Known files keep their order: this process saw
        their use, and mtimes may tie at the filesystem's timestamp granularity."""
        on_disk: dict[Path, tuple[int, int]] = {}
        for p in self.root.glob(f"??/*{_SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            on_disk[p] = (st.st_mtime_ns, st.st_size)
        for p in [p for p in self._index if p not in on_disk]:
            del self._index[p]
        for p in self._index:
            self._index[p] = on_disk[p][1]
        for mtime, p in sorted((m, p) for p, (m, _) in on_disk.items() if p not in self._index):
            self._index[p] = on_disk[p][1]
        self._bytes = sum(self._index.values())
        self._written_since_scan = 0

    def _evict(self) -> list[Path]:
        """Remove LRU entries until within budget (caller holds the lock, so no reader re-adds a
        file between its removal from the index and from the disk)."""
        victims: list[Path] = []
        if self.max_bytes is None:
            return victims
        while self._bytes > self.max_bytes and self._index:
            path, size = self._index.popitem(last=False)
            self._bytes -= size
            path.unlink(missing_ok=True)
            victims.append(path)
        return victims

    def _temp_file(self, shard: Path) -> tuple[int, str]:
        """A new temp file in ``shard``; the shard is made when missing, and with it the root when
        that was deleted while the store ran (its entries went with it: the index forgets them)."""
        try:
            return tempfile.mkstemp(prefix=_TMP_PREFIX, dir=shard)
        except FileNotFoundError:
            pass
        root_gone = not self.root.is_dir()
        shard.mkdir(parents=True, exist_ok=True)
        if root_gone:
            with self._lock:
                self._rescan()
            self._count("root_recreated")
        return tempfile.mkstemp(prefix=_TMP_PREFIX, dir=shard)

    def _keep(self, path: Path, key: str) -> bool:
        """``keep_existing``: when ``path`` holds an entry that reads back whole, keep it (counted
        kept). A damaged one is removed and the put replaces it: reads stop at a chain's first
        missing page, so a damaged page further down is never read (hence never removed) by a
        ``get``, and an existence check alone kept it for good. Reading the entry costs less than the
        write it saves, and only puts that find an entry pay it."""
        if self._read_whole(path, key) is None:
            return False
        self._count("kept")
        return True

    def _read_whole(self, path: Path, key: str) -> bytes | None:
        """The value of the entry at ``path``, marked used (index order, mtime); None when it is
        missing, unreadable or damaged (counted ``corrupt`` and removed). A put may replace a damaged
        entry between its read and its removal (the KV writer saving the page a fetch found
        damaged): the removal spares a file that is no longer the one read, and that one is read
        instead, once -- removing by name would delete the new entry, its page lost from L3 although
        the writer counted it written."""
        for _ in range(2):
            opened = self._open_entry(path, key)
            if opened is None:
                return None
            f, value, size = opened
            with f:  # held open until the removal below: the file's inode cannot be reused meanwhile
                if value is None:
                    self._count("corrupt")
                    if self._remove_unless_replaced(path, os.fstat(f.fileno())):
                        continue
                    return None
            self._touch(path, size)
            return value
        return None

    def _open_entry(self, path: Path, key: str) -> tuple[BinaryIO, bytes | None, int] | None:
        """The entry at ``path`` read: (the file, still open so that its inode is not reused while
        the caller decides; its value, None when damaged; its size), or None when it is missing or
        unreadable (counted ``errors``: a miss, a put writes over it)."""
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            self._forget(path)
            return None
        except OSError:
            self._count("errors")
            return None
        try:
            raw = f.read()
        except OSError:
            f.close()
            self._count("errors")
            return None
        try:
            return f, decode_entry(raw, key), len(raw)
        except CorruptEntry:
            return f, None, len(raw)

    def _remove_unless_replaced(self, path: Path, read: os.stat_result) -> bool:
        """Remove the damaged file ``read`` (its ``fstat``) unless ``path`` names another file now:
        then ``True`` (a put replaced it since it was read). Checked and unlinked under the lock this
        process's renames hold; a process sharing the directory could still land in between: rare,
        and its entry is lost from L3, never served wrong."""
        with self._lock:
            try:
                now = os.stat(path)
            except FileNotFoundError:
                self._bytes -= self._index.pop(path, 0)
                return False
            except OSError:
                self._count("errors")
                return False
            if (now.st_dev, now.st_ino) != (read.st_dev, read.st_ino):
                return True
            self._bytes -= self._index.pop(path, 0)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:  # read-only filesystem, permissions: it still reads as a miss
                self._count("errors")
        return False

    def _touch(self, path: Path, size: int) -> None:
        with self._lock:
            try:
                os.utime(path)  # recency survives a restart
            except FileNotFoundError:  # evicted (by us or a process sharing the directory) since read
                self._bytes -= self._index.pop(path, 0)
                return
            except OSError:
                pass
            self._bytes += size - self._index.pop(path, 0)
            self._index[path] = size

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._bytes -= self._index.pop(path, 0)

    def _remove(self, path: Path) -> bool:
        """Forget and unlink ``path``; ``False`` when nothing was removed (gone already, or the
        filesystem refused: read-only, permissions -- counted in ``errors``; a store never raises,
        and a damaged entry left behind still reads as a miss)."""
        self._forget(path)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError:
            self._count("errors")
            return False
