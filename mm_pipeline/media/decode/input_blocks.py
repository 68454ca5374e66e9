"""The encoded bytes of the items a ``ProcessDecodeBackend`` decodes, in shared-memory blocks its
worker processes read: one block per item, made by the item's first job and freed by its last user.

Users are the jobs in flight (``share`` / ``release``, on the worker threads that wait for them) and
the holds (``hold``, around all the chunks of one video). Without a hold, chunks that do not overlap
(one worker; or two whose jobs happen to alternate) each made a new block of the whole file, and
each job's worker copied it out again: a 60 s 720p clip (8 MB, 30 chunks) on one worker process
cost 1.85 s of CPU, 1.55 s held, against a thread's 1.27-1.40 s (``pipeline.py --decode-only``,
alternating runs).

A hold is entered and left on the event loop, so it never touches ``item.data`` (a
``DeferredMediaItem`` would load its bytes there) and never frees a block on the caller's thread:
unmapping and unlinking costs ~2 ms per 8 MB here, ~30-70 ms for a 128 MB upload. The first job of a
held item ties the hold to the item's block; the hold's end drops that reference, and a block it
frees is freed on a thread of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory

from mm_pipeline.media.types import MediaItem


class InputBlocks:
    def __init__(self, prefix: str, names: itertools.count) -> None:
        self._prefix = prefix
        self._names = names  # shared with the backend's result blocks: every name is unique
        self._lock = threading.Lock()
        # id(item.data) -> [block, users (jobs, and one per hold tied to it), the bytes (kept alive)]
        self._blocks: dict[int, list] = {}
        # id(item) -> [holds open, the id(item.data) its first job tied them to, or None]
        self._holds: dict[int, list] = {}
        self._freeing: list[threading.Thread] = []

    def share(self, item: MediaItem) -> tuple[str, int]:
        """A job of ``item`` starts (on a worker thread): its block's name and the bytes' length."""
        data = item.data
        key = id(data)
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                block = shared_memory.SharedMemory(f"{self._prefix}_in{next(self._names)}", create=True,
                                                   size=max(1, len(data)))
                block.buf[:len(data)] = data
                entry = self._blocks[key] = [block, 0, data]
            entry[1] += 1
            held = self._holds.get(id(item))
            if held is not None and held[1] is None:  # the hold keeps the block from now on
                held[1] = key
                entry[1] += 1
            return entry[0].name, len(data)

    def release(self, item: MediaItem) -> None:
        """A job of ``item`` ended (on its worker thread): the last user frees the block here."""
        self._drop(id(item.data), free_here=True)

    @contextlib.contextmanager
    def hold(self, item: MediaItem) -> Iterator[None]:
        """Keep ``item``'s block from its first job until the block ends (fit for the event loop)."""
        with self._lock:
            held = self._holds.setdefault(id(item), [0, None])
            held[0] += 1
        try:
            yield
        finally:
            with self._lock:
                held[0] -= 1
                key = None
                if held[0] == 0:
                    if self._holds.get(id(item)) is held:
                        del self._holds[id(item)]
                    key = held[1]
            if key is not None:
                self._drop(key, free_here=False)

    def close(self) -> None:
        """Free every block still kept (holds still open: their end finds nothing); wait for the
        blocks being freed. Called once no worker reads any block."""
        with self._lock:
            blocks = [entry[0] for entry in self._blocks.values()]
            self._blocks.clear()
            self._holds.clear()
            freeing = list(self._freeing)
        for block in blocks:
            _free(block)
        for thread in freeing:
            thread.join()

    def _drop(self, key: int, free_here: bool) -> None:
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._blocks[key]
            if not free_here:  # started under the lock: close() joins only started threads
                thread = threading.Thread(target=_free, args=(entry[0],), name="mmserve-shm-free", daemon=True)
                self._freeing = [t for t in self._freeing if t.is_alive()] + [thread]
                thread.start()
                return
        _free(entry[0])


def _free(block: shared_memory.SharedMemory) -> None:
    block.close()
    block.unlink()
