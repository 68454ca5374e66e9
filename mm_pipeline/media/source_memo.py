"""SourceMemo: the content key of a media source hashed before, known without its bytes again.

A repeated request names its media the same way -- the same data URL text, the same local file --
and the encoder cache keeps its units under the content key (blake3 of the bytes). Yet decoding a
12 s 720p video's data URL takes 10-30 ms on the 2-core host (base64, GIL held), reading and hashing
a 60 s file ~10 ms, and a repeat answered from the cache needs neither. The memo maps what
identifies a source's bytes to their content key:

  data URL    blake3 of the payload text -> content key. Always trusted: the text decides the bytes.
  local file  (real path, device, inode, size, mtime_ns, ctime_ns) -> content key. Trusted only if
              the file's ctime was at least ``racy_s`` older than the read the key came from. Every
              write sets ctime to "now" and no system call sets it back (``touch -d``/``rsync -t``
              restore mtime, not ctime), so an unchanged tuple means an unchanged file -- except for a
              rewrite of the same size within one timestamp tick of that read, which is why a file
              changed that recently is never remembered (git's "racily clean" rule).

Ingest turns a hit into a ``DeferredMediaItem``: the bytes are decoded or read only if something
needs them (a unit missing from the encoder cache). A file's deferred read hashes what it reads and
refuses content other than the remembered key's, so a stale entry can never put one content's
embeddings under another's key. Bounded LRU, thread-safe (ingest runs on the media workers).
Entries are kept per cache_salt (``salt``; None is one too): a hit skips hashing and the sniff, so
a memo shared across salts would let one tenant time whether another sent the same source.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Hashable

import blake3

RACY_S = 2.0  # coarser than any file system's timestamp tick (ext4/xfs: ~4 ms jiffies; FAT: 2 s)


_PIECE = 1 << 16  # characters hashed at a time: below malloc's mmap threshold, so the pieces reuse one block


def data_url_id(url: str, scheme: str = "data") -> tuple[str, bytes] | None:
    """The memo id of a ``data:`` URL: blake3 of its text (None when it is not ASCII, which never
    decodes anyway); ``scheme="base64"`` for a bare base64 payload (``MediaSource.base64``), whose
    ids never meet a data URL's: the same text is a valid source as one and not as the other.
    0.5 ms for the 2.4 MB text of a 12 s 720p clip, against 10+ ms to decode it. Hashed piece by
    piece, never encoded whole: a copy of a 5.5 MB text is fresh memory, and on the 2-core host its
    page faults took the id from ~1 ms to 3-8 ms of the request's CPU (measured in the engine)."""
    if not url.isascii():  # (O(1): a str knows whether it is ASCII)
        return None
    digest = blake3.blake3()
    for start in range(0, len(url), _PIECE):
        digest.update(url[start:start + _PIECE].encode("ascii"))
    return (scheme, digest.digest())


class DataUrlIds:
    """``data_url_id`` with the texts of the last data URLs kept (``max_chars`` in all): a URL equal
    to a kept one gets its id after one comparison -- 0.05 ms for the 2.4 MB text of a 12 s 720p
    clip, where blake3 over it takes 0.3 ms, on the path of every repeat and every new question
    about the same media. Kept texts are found by their length and ends (O(1)); only an exact
    match counts, so two URLs that share them merely replace each other. Kept per cache_salt
    (``salt``), as the memos are: the faster answer must not tell one tenant another's URL.
    Thread-safe."""

    ENDS = 64  # characters of each end in the lookup key

    def __init__(self, max_chars: int = 64 << 20) -> None:
        if max_chars < 0:
            raise ValueError(f"DataUrlIds needs max_chars >= 0, got {max_chars}")
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str | None, int, str, str], tuple[str, tuple[str, bytes]]] = OrderedDict()
        self._chars = 0

    def __call__(self, url: str, scheme: str = "data", salt: str | None = None) -> tuple[str, bytes] | None:
        """``url``'s id (``data_url_id(url, scheme)``)."""
        where = (scheme, salt, len(url), url[:self.ENDS], url[-self.ENDS:])
        with self._lock:
            kept = self._kept.get(where)
        if kept is not None and (kept[0] is url or kept[0] == url):  # compared outside the lock
            with self._lock:
                if where in self._kept:
                    self._kept.move_to_end(where)
            return kept[1]
        found = data_url_id(url, scheme)
        if found is not None and len(url) <= self.max_chars:
            with self._lock:
                old = self._kept.pop(where, None)
                self._chars += len(url) - (len(old[0]) if old is not None else 0)
                self._kept[where] = (url, found)
                while self._chars > self.max_chars:
                    _, (text, _) = self._kept.popitem(last=False)
                    self._chars -= len(text)
        return found

    @property
    def chars(self) -> int:
        """Characters of the kept texts."""
        with self._lock:
            return self._chars


def file_id(real_path: str, st: os.stat_result) -> tuple:
    """The memo id of a regular file from its ``stat`` (after ingest's path checks)."""
    return ("file", real_path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class SourceMemo:
    """Source id -> content key (see module doc)."""

    def __init__(self, max_entries: int = 4096, racy_s: float = RACY_S) -> None:
        if max_entries < 0 or racy_s < 0:
            raise ValueError(f"SourceMemo needs max_entries >= 0 and racy_s >= 0, got {max_entries}, {racy_s}")
        self.max_entries = max_entries
        self.racy_s = racy_s
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str | None, Hashable], str] = OrderedDict()

    def get(self, source_id: Hashable | None, salt: str | None = None) -> str | None:
        if source_id is None:
            return None
        entry = (salt, source_id)
        with self._lock:
            key = self._entries.get(entry)
            if key is not None:
                self._entries.move_to_end(entry)
            return key

    def put(self, source_id: Hashable | None, content_key: str, read_at: float | None = None,
            salt: str | None = None) -> bool:
        """Remember ``content_key`` for ``source_id``; a file id only when its ctime is ``racy_s``
        older than ``read_at`` (``time.time()``, the clock of file timestamps, taken just before its bytes
        were read). Whether it did."""
        if source_id is None or self.max_entries == 0:
            return False
        if source_id[0] == "file":
            ctime_s = source_id[-1] / 1e9
            if read_at is None or read_at - ctime_s < self.racy_s:
                return False
        entry = (salt, source_id)
        with self._lock:
            self._entries[entry] = content_key
            self._entries.move_to_end(entry)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
