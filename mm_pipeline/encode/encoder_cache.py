"""Encoder output cache: content key → embedding tensor, over tiers of key → bytes stores.

    get(key):  memory ──miss──► disk ──miss──► redis ──miss──► None
                 ▲  promote ◄──hit─┘   promote ◄──hit─┘
    put(key):  memory (now) ──► disk, redis (write-behind thread; inline when its queue is full)

Tensors are stored as safetensors bytes, so every hit returns a fresh tensor: a caller that
modifies its copy cannot damage the cache.  Tensors come back on the CPU.

Keys are content hashes (``content_hash``): a key's value never changes, so a tier that lags
behind a write-behind copy can only miss, never answer with a different embedding.

The cache only stores: concurrent requests for one uncached unit share one encoding through the
batcher's single flight (single_flight.py), whose result ``on_encoded`` writes here.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Sequence

import safetensors
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from llm_core.storage import KeyValueStore, LocalDirStore, MemoryStore, RedisStore

_TENSOR_NAME = "embedding"


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return st_save({_TENSOR_NAME: tensor.detach().to("cpu").contiguous()})


def tensor_from_bytes(blob: bytes) -> torch.Tensor:
    """Inverse of ``tensor_to_bytes``; raises ``ValueError`` for bytes that are not one."""
    try:
        return st_load(blob)[_TENSOR_NAME]
    except (safetensors.SafetensorError, KeyError, ValueError) as exc:
        raise ValueError(f"cached value is not a serialised tensor ({exc})") from exc


class EncoderCache:
    """Tiered, write-through embedding cache."""

    def __init__(self, tiers: Sequence[KeyValueStore], namespace: str = "enc:",
                 write_behind_queue: int = 256) -> None:
        if not tiers:
            raise ValueError("EncoderCache needs at least one tier")
        if write_behind_queue < 1:
            raise ValueError(f"write_behind_queue must be >= 1, got {write_behind_queue}")
        self.tiers = list(tiers)
        names = [t.name for t in self.tiers]
        self.tier_names = [n if names.count(n) == 1 else f"{n}{i}" for i, n in enumerate(names)]
        self.namespace = namespace
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[str, bytes, list[KeyValueStore]] | None] = queue.Queue(
            write_behind_queue)
        self._writer = threading.Thread(target=self._write_loop, name="encoder-cache-writer", daemon=True)
        self._writer.start()

    @classmethod
    def tiered(cls, memory_bytes: int, directory: str | None = None, disk_bytes: int | None = None,
               redis_url: str | None = None) -> "EncoderCache":
        """Memory LRU, then the local directory (survives restarts), then Redis, as given."""
        tiers: list[KeyValueStore] = [MemoryStore(memory_bytes)]
        if directory is not None:
            tiers.append(LocalDirStore(directory, max_bytes=disk_bytes))
        if redis_url is not None:
            tiers.append(RedisStore.from_url(redis_url))
        return cls(tiers)

    # ---- public API -------------------------------------------------------------------------

    def get(self, key: str, manifest: bool = False, *, count_hit: bool = True,
            count_miss: bool = True) -> torch.Tensor | None:
        """Look ``key`` up tier by tier; a hit is copied into the tiers above it. ``manifest``: a
        media item's manifest (its units' sizes), counted apart (``manifest_hits`` /
        ``manifest_misses``) so that ``hits`` and ``misses`` count encoder units, as the
        X-Encoder-Cache-Hits header and the stats line do.

        A request's unit or manifest is counted by one lookup only: the planner decides which
        (planner.py, "Counting lookups") and reads again with ``count_hit`` / ``count_miss``
        off, so that ``hits + misses`` is the units requests asked for, not the reads made."""
        skey = self.namespace + key
        for i, tier in enumerate(self.tiers):
            blob = tier.get(skey)
            if blob is None:
                continue
            try:
                tensor = tensor_from_bytes(blob)
            except ValueError:
                tier.delete(skey)  # intact entry, foreign content: drop it, keep looking
                self._count("bad_values")
                continue
            if count_hit:
                self._count("manifest_hits" if manifest else f"hits.{self.tier_names[i]}")
            if i > 0:
                self._store(skey, blob, self.tiers[:i])
            return tensor
        if count_miss:
            self._count("manifest_misses" if manifest else "misses")
        return None

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` to every tier (the first now, the rest write-behind)."""
        self._store(self.namespace + key, tensor_to_bytes(tensor), self.tiers)

    def flush(self) -> None:
        """Block until every write-behind write has reached its tier."""
        self._writes.join()

    def stats(self) -> dict[str, object]:
        """``hits`` per tier name and ``misses`` (encoder units), ``manifest_hits`` /
        ``manifest_misses``, ``bad_values``, ``pending_writes``."""
        with self._lock:
            c = dict(self._counts)
        return {
            "hits": {n: c.get(f"hits.{n}", 0) for n in self.tier_names},
            **{k: c.get(k, 0) for k in ("misses", "manifest_hits", "manifest_misses", "bad_values")},
            "pending_writes": self._writes.unfinished_tasks,
        }

    def check_integrity(self) -> None:
        """Call when idle: drains write-behind, then checks every tier."""
        self.flush()
        for tier in self.tiers:
            tier.check_integrity()

    def close(self) -> None:
        """Finish pending writes and stop the writer thread (the tiers stay open)."""
        self._writes.put(None)
        self._writer.join()

    # ---- internal helpers -------------------------------------------------------------------

    def _store(self, skey: str, blob: bytes, tiers: list[KeyValueStore]) -> None:
        tiers[0].put(skey, blob)
        if len(tiers) > 1:
            try:
                self._writes.put_nowait((skey, blob, tiers[1:]))
            except queue.Full:  # backpressure: the caller pays for the slow tiers itself
                for tier in tiers[1:]:
                    tier.put(skey, blob)

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            try:
                if job is None:
                    return
                skey, blob, tiers = job
                for tier in tiers:
                    tier.put(skey, blob)  # stores turn their own failures into dropped writes
            finally:
                self._writes.task_done()

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
