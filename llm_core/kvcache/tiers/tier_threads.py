"""The KV tiers' background threads: the layer-wise loader (L2/L3 -> L1) and the L3 writer.

    engine thread                      loader thread                    writer thread
    submit(copies) ──► _loads ──► layer 0 rows -> L1, set event 0
                                  layer 1 rows -> L1, set event 1 ...
    model: kv_buffers(pool).layer(i) waits on event i of every pending job
    put(h, ...) / touch(chain) ─► _writes ──────────────────────────► store.put / store.touch

A failed load sets every event of its job (so no model step hangs) and marks the threads ``broken``:
the waiting step raises, and the prefix cache stops handing out tree pages (docs/kv_cache.md §8).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.tiers.page_format import encode_page, scatter_layer, store_key
from llm_core.storage import KeyValueStore

LayerCopies = dict[int, list[tuple[list[int], torch.Tensor]]]  # layer -> [(L1 pages, rows)]


@dataclass
class LoadJob:
    """Copies into L1, grouped per layer; ``wait(i)`` returns once layer i is in place."""

    copies: LayerCopies
    events: list[threading.Event] = field(default_factory=list)
    error: BaseException | None = None

    def wait(self, layer: int) -> None:
        self.events[layer].wait()
        if self.error is not None:
            raise RuntimeError(f"loading cached KV into layer {layer} failed: {self.error}") from self.error


class LayerwiseKV:
    """The model's KV buffers while loads are pending: ``layer(i)`` waits for layer i's copies."""

    def __init__(self, pool: DualKVPool, jobs: list[LoadJob]) -> None:
        self.pool, self.jobs = pool, jobs

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        for job in self.jobs:
            job.wait(i)
        return self.pool.layer(i)


def add_layer_copies(copies: LayerCopies, pool: DualKVPool, kind: str, pages: list[int],
                     rows: list[torch.Tensor]) -> None:
    """Add ``rows`` (one per page, of ``kind``) to every layer of that kind in ``copies``."""
    if not pages:
        return
    stacked = torch.stack(rows)
    for layer, k in enumerate(pool.layout.layer_kinds):
        if k == kind:
            copies.setdefault(layer, []).append((pages, stacked))


class KVTierThreads:
    """Loader and writer threads of one ``KVTiers``: queues, pending load jobs, thread lifecycle.

    ``broken`` is the error of the first failed load (None while every load succeeded); ``counters``
    counts L3 puts, touches and errors."""

    def __init__(self, pool: DualKVPool, store: KeyValueStore | None) -> None:
        self.pool = pool
        self.store = store
        self.broken: BaseException | None = None
        self.counters: Counter[str] = Counter()
        self._jobs: list[LoadJob] = []  # submitted and not yet seen complete (engine thread only)
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._load_loop, name="kv-loader", daemon=True)]
        if store is not None:
            self._threads.append(threading.Thread(target=self._write_loop, name="kv-writer", daemon=True))
        for t in self._threads:
            t.start()

    # ---- loads (engine thread) ---------------------------------------------------------------
    def submit(self, copies: LayerCopies) -> LoadJob:
        """Queue copies into L1; the returned job's ``wait(i)`` blocks until layer i has landed."""
        job = LoadJob(copies, [threading.Event() for _ in self.pool.layout.layer_kinds])
        self._jobs.append(job)
        self._loads.put(job)
        return job

    def kv_buffers(self, pool: DualKVPool):
        """The pool, or a ``LayerwiseKV`` view while loads are pending; raises if a load failed."""
        failed = next((j.error for j in self._jobs if j.error is not None), None)
        if failed is not None:
            self._jobs = [j for j in self._jobs if j.error is None]
            raise RuntimeError(f"loading cached KV failed: {failed}") from failed
        self._jobs = [j for j in self._jobs if not j.events[-1].is_set()]
        return LayerwiseKV(pool, self._jobs) if self._jobs else pool

    def wait_loads(self) -> None:
        """Block until every queued load has landed (before L1 pages are read for saving or freed)."""
        for job in self._jobs:
            job.events[-1].wait()

    # ---- L3 writes (engine thread) -------------------------------------------------------------
    def put(self, h: bytes, full: torch.Tensor, swa: torch.Tensor | None) -> None:
        """Write the page with chain hash ``h`` to L3 in the background."""
        self._writes.put(("put", h, full, swa))

    def touch(self, chain: list[bytes]) -> None:
        """Refresh the store's recency of every page in ``chain`` in the background (one batch)."""
        self._writes.put(("touch", chain, None, None))

    def join_writes(self) -> None:
        """Block until every queued L3 write is done."""
        if self.store is not None:
            self._writes.join()

    def stop(self) -> None:
        """Let queued loads land, stop both threads, then close the store."""
        self.wait_loads()
        self._loads.put(None)
        if self.store is not None:
            self._writes.put(None)
        for t in self._threads:
            t.join(timeout=10)
        if self.store is not None:
            self.store.close()

    # ---- the threads -------------------------------------------------------------------------
    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            try:
                for layer, event in enumerate(job.events):
                    for pages, rows in job.copies.get(layer, ()):
                        scatter_layer(self.pool, layer, pages, rows)
                    if self.pool.device.type == "cuda":
                        torch.cuda.current_stream(self.pool.device).synchronize()
                    event.set()
            except BaseException as exc:  # the waiting model step reports it
                job.error = self.broken = exc
                for event in job.events:
                    event.set()

    def _write_loop(self) -> None:
        assert self.store is not None
        while (item := self._writes.get()) is not None:
            op, what, full, swa = item  # what: a page hash (put) or a chain of them (touch)
            try:
                if op == "put":
                    self.store.put(store_key(what), encode_page(full, swa))
                    self.counters["l3_puts"] += 1
                else:
                    self.store.touch([store_key(h) for h in what])
                    self.counters["l3_touches"] += 1
                    self.counters["l3_touched_pages"] += len(what)
            except Exception:  # a cache tier may forget; the store counts its own errors
                self.counters["l3_errors"] += 1
            finally:
                self._writes.task_done()
