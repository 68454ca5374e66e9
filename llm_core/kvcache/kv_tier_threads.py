"""The KV tiers' background threads: the layer-wise loader (L2/L3 -> L1) and the L3 writer.

    engine thread                      loader thread                    writer thread
    _submit(copies) ──► _loads ──► layer 0 rows -> L1, set event 0
                                   layer 1 rows -> L1, set event 1 ...
    model: kv_buffers(pool).layer(i) waits on event i of every pending job
    _writes.put(("put" | "touch", ...)) ───────────────────────────► store.put / store.get

A failed load sets every event of its job (so no model step hangs) and marks the tiers ``broken``:
the waiting step raises, and the prefix cache stops handing out tree pages.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.host_kv_pool import encode_page, scatter_layer
from llm_core.storage import KeyValueStore


@dataclass
class LoadJob:
    """Copies into L1, grouped per layer; ``wait(i)`` returns once layer i is in place."""

    copies: dict[int, list[tuple[list[int], torch.Tensor]]]  # layer -> [(L1 pages, rows)]
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


class KVTierThreads:
    """Loader and writer threads of ``KVTiers`` (a base of it): queues, load jobs, thread lifecycle.

    It reads ``pool``, ``store`` and ``counters`` of the tiers and sets ``broken`` on a failed load."""

    pool: DualKVPool
    store: KeyValueStore | None
    counters: Counter[str]
    broken: BaseException | None

    def _start_threads(self) -> None:
        self._jobs: list[LoadJob] = []
        self._loads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._load_loop, name="kv-loader", daemon=True)]
        if self.store is not None:
            self._threads.append(threading.Thread(target=self._write_loop, name="kv-writer", daemon=True))
        for t in self._threads:
            t.start()

    def _stop_threads(self) -> None:
        """Let queued loads land, stop both threads, then close the store."""
        self.wait_loads()
        self._loads.put(None)
        if self.store is not None:
            self._writes.put(None)
        for t in self._threads:
            t.join(timeout=10)
        if self.store is not None:
            self.store.close()

    # ---- loads -----------------------------------------------------------------------------------
    def _add_copies(self, copies: dict, kind: str, pages: list[int], rows: list[torch.Tensor]) -> None:
        if not pages:
            return
        stacked = torch.stack(rows)
        for layer, k in enumerate(self.pool.layout.layer_kinds):
            if k == kind:
                copies.setdefault(layer, []).append((pages, stacked))

    def _submit(self, copies: dict) -> None:
        job = LoadJob(copies, [threading.Event() for _ in self.pool.layout.layer_kinds])
        self._jobs.append(job)
        self._loads.put(job)

    def kv_buffers(self, pool: DualKVPool):
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

    # ---- L3 writes -------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            op, h, full, swa = item
            try:
                if op == "put":
                    self.store.put(_store_key(h), encode_page(full, swa))
                    self.counters["l3_puts"] += 1
                else:
                    self.store.get(_store_key(h))  # a read refreshes the entry's recency
                    self.counters["l3_touches"] += 1
            except Exception:  # a cache tier may forget; the store counts its own errors
                self.counters["l3_errors"] += 1
            finally:
                self._writes.task_done()


def _store_key(h: bytes) -> str:
    return "kv/" + h.hex()
