"""The KV tiers' background threads: the layer-wise loader (L2/L3 -> L1) and the L3 writer.

    engine thread                      loader thread                    writer thread
    submit(copies) ──► _loads ──► layer 0 rows -> L1, set event 0
                                  layer 1 rows -> L1, set event 1 ...
    model: kv_buffers(pool).layer(i) waits on event i of every pending job
    put(h, ...) / touch(chain) ─► _writes ──────────────────────────► store.put / store.touch
                                  (at most write_queue_bytes;         on_written(h, ...) once the
                                   past that a write is dropped)      store kept the page

A failed load sets every event of its job (so no model step hangs) and marks the threads ``broken``:
the waiting step raises, and the prefix cache stops handing out tree pages (docs/kv_cache.md §8).

On CUDA the loader copies on a stream of its own (``CopyOrder``): layer i+1's rows cross while the
model computes layer i, and neither thread waits for the GPU. The copies start after the work the
engine had queued when it submitted the job (a step still running may read the pages being filled),
and each layer's copies end in a CUDA event that the reading stream waits on, on the device.

The write queue holds rows of evicted pages until the store has them; a store slower than eviction
must not grow it without bound nor make the engine thread wait, so a write that would take it past
``write_queue_bytes`` is dropped (counted). Only a write the store confirmed calls ``on_written``: a
dropped or failed one leaves the page unmarked, to be written again at its next eviction. ``stop``
gives the queued writes ``close_timeout_s``, then abandons the rest (counted, logged) so a hung
store cannot hang shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.tiers.page_format import encode_page, layer_columns, scatter_layer, store_key
from llm_core.storage import KeyValueStore

log = logging.getLogger(__name__)

LayerCopies = dict[int, list[tuple[list[int], torch.Tensor]]]  # layer -> [(L1 pages, that layer's columns of their rows)]
WRITE_QUEUE_BYTES = 256 << 20  # rows waiting for the L3 writer at most; past it writes are dropped
CLOSE_TIMEOUT_S = 5.0  # how long stop() waits for queued L3 writes before abandoning them


class CopyOrder:
    """Orders the loader's copies against the model's work on ``device`` (see the module doc). On
    CPU there is nothing to order: a layer's rows are in place when its host event is set, and
    every method is a no-op returning None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = None  # the loader's copy stream (made on the loader thread's first job)

    def submitted(self):
        """Engine thread, at submit: an event after the work queued so far on its stream."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copying(self, after):
        """Loader thread: the context one job's copies run in -- the copy stream, once it has waited
        (on the device) for ``after``."""
        if not self.cuda:
            return contextlib.nullcontext()
        ctx = contextlib.ExitStack()
        try:
            # the pool's device current first: leaving the stream context restores the thread's
            # device's stream, and with cuda:0 current a pool on cuda:1 would open a context on GPU 0
            ctx.enter_context(torch.cuda.device(self.device))
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_event(after)
            ctx.enter_context(torch.cuda.stream(self._stream))
        except BaseException:
            ctx.close()  # the loader thread's device as it was
            raise
        return ctx

    def landed(self):
        """Loader thread: an event after the copies queued so far (None before the first job)."""
        if not self.cuda or self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait(self, landed) -> None:
        """A reading thread: its stream waits (on the device) for ``landed``."""
        if landed is not None:
            torch.cuda.current_stream(self.device).wait_event(landed)


@dataclass
class LoadJob:
    """Copies into L1, grouped per layer; ``wait(i)`` returns once layer i is in place -- on CUDA,
    once the caller's stream is ordered after its copies."""

    copies: LayerCopies
    events: list[threading.Event] = field(default_factory=list)
    error: BaseException | None = None
    order: CopyOrder | None = None
    submitted: object = None  # CopyOrder.submitted() at submit (CUDA)
    landed: list = field(default_factory=list)  # per layer: CopyOrder.landed() once queued (CUDA)

    def wait(self, layer: int) -> None:
        self.events[layer].wait()
        if self.error is not None:
            raise RuntimeError(f"loading cached KV into layer {layer} failed: {self.error}") from self.error
        if self.order is not None:
            self.order.wait(self.landed[layer])

    def settle(self) -> None:
        """Wait for the whole job (the copy stream runs in order: its last event covers them all),
        without raising: a failed job's error is reported by the step that waits on it. A failed
        job is waited for too: the copies it queued before failing land in pages L1 may reuse."""
        self.events[-1].wait()
        if self.order is not None:
            self.order.wait(self.landed[-1])


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
    """Add ``rows`` (one per page, of ``kind``) to every layer of that kind in ``copies``, each layer
    getting its own columns of them: each layer's copy moves that layer's bytes alone (the whole
    rows for every layer moved the page L times over)."""
    if not pages:
        return
    stacked = torch.stack(rows)
    for layer, k in enumerate(pool.layout.layer_kinds):
        if k == kind:
            part = stacked[:, layer_columns(pool.layout, pool.page_size, layer)]
            copies.setdefault(layer, []).append((pages, part))


class KVTierThreads:
    """Loader and writer threads of one ``KVTiers``: queues, pending load jobs, thread lifecycle.

    ``broken`` is the error of the first failed load (None while every load succeeded); ``stats()``
    counts L3 puts (kept by the store), failed puts, touches, errors, writes dropped because the queue
    was full and writes abandoned at ``stop``, and the bytes queued now. ``on_written(h, with_swa)``
    is called on the writer thread after the store kept page ``h``."""

    def __init__(self, pool: DualKVPool, store: KeyValueStore | None, *,
                 on_written: Callable[[bytes, bool], None] | None = None,
                 write_queue_bytes: int = WRITE_QUEUE_BYTES, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if write_queue_bytes < 0 or close_timeout_s < 0:
            raise ValueError(f"KVTierThreads needs write_queue_bytes >= 0 and close_timeout_s >= 0, got "
                             f"{write_queue_bytes}, {close_timeout_s}")
        self.pool = pool
        self.store = store
        self.on_written = on_written
        self.write_queue_bytes, self.close_timeout_s = write_queue_bytes, close_timeout_s
        self.broken: BaseException | None = None
        self.order = CopyOrder(pool.device)
        self.counters: Counter[str] = Counter()
        self._count_lock = threading.Lock()  # the engine thread (drops) and the writer both count
        self._jobs: list[LoadJob] = []  # submitted and not yet seen complete (engine thread only)
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._writes: queue.Queue = queue.Queue()  # bounded in bytes by _enqueue, not in items
        self._queue_state = threading.Condition()  # guards the two below; notified when a write is done
        self._queued_bytes = 0
        self._queued_items = 0  # queued and not yet done
        self._loader = threading.Thread(target=self._load_loop, name="kv-loader", daemon=True)
        self._writer = (threading.Thread(target=self._write_loop, name="kv-writer", daemon=True)
                        if store is not None else None)
        for t in (self._loader, self._writer):
            if t is not None:
                t.start()

    # ---- loads (engine thread) ---------------------------------------------------------------
    def submit(self, copies: LayerCopies) -> LoadJob:
        """Queue copies into L1; the returned job's ``wait(i)`` blocks until layer i has landed."""
        n = len(self.pool.layout.layer_kinds)
        job = LoadJob(copies, [threading.Event() for _ in range(n)], order=self.order,
                      submitted=self.order.submitted(), landed=[None] * n)
        self._jobs.append(job)
        self._loads.put(job)
        return job

    def kv_buffers(self, pool: DualKVPool):
        """The pool, or a ``LayerwiseKV`` view while loads are pending; raises if a load failed."""
        # finished jobs first, then their errors: a job that fails after this snapshot still has
        # an event unset, stays, and is caught by the step's wait or the next call -- never dropped
        done = [j for j in self._jobs if j.events[-1].is_set()]
        for job in done:  # order this step after their copies (a failed job's too) before forgetting them
            job.settle()
        self._jobs = [j for j in self._jobs if not any(j is d for d in done)]
        failed = next((j.error for j in done if j.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"loading cached KV failed: {failed}") from failed
        return LayerwiseKV(pool, self._jobs) if self._jobs else pool

    def wait_loads(self) -> None:
        """Block until every queued load has landed (before L1 pages are read for saving or freed)."""
        for job in self._jobs:
            job.settle()

    # ---- L3 writes (engine thread) -------------------------------------------------------------
    def put(self, h: bytes, full: torch.Tensor, swa: torch.Tensor | None) -> bool:
        """Write the page with chain hash ``h`` to L3 in the background; False when the queue is full
        (dropped, counted in ``l3_puts_dropped``; ``on_written`` is never called for it)."""
        size = full.numel() * full.element_size() + (0 if swa is None else swa.numel() * swa.element_size())
        return self._enqueue(("put", h, full, swa), size, "l3_puts_dropped")

    def touch(self, chain: list[bytes]) -> bool:
        """Refresh the store's recency of every page in ``chain`` in the background (one batch); False
        when the queue is full (dropped, counted in ``l3_touches_dropped``)."""
        return self._enqueue(("touch", chain, None, None), sum(len(h) for h in chain), "l3_touches_dropped")

    def join_writes(self, timeout_s: float | None = None) -> bool:
        """Block until every queued L3 write is done, or ``timeout_s`` passed; True when they are."""
        if self.store is None:
            return True
        with self._queue_state:
            return self._queue_state.wait_for(lambda: self._queued_items == 0, timeout_s)

    def stop(self) -> None:
        """Let queued loads land, give queued L3 writes ``close_timeout_s`` (then abandon the rest),
        stop both threads, then close the store."""
        self.wait_loads()
        self._loads.put(None)
        if self._writer is not None:
            if not self.join_writes(self.close_timeout_s):
                self._abandon_writes()
            self._writes.put(None)
        self._loader.join(timeout=10)
        if self._writer is not None:
            self._writer.join(timeout=1.0)  # idle unless abandoned inside a hung store call (a daemon)
        if self.store is not None:
            self.store.close()

    def stats(self) -> dict[str, int]:
        """The counters (see the class docstring) and, with a store, ``l3_write_queue_bytes``."""
        with self._count_lock:
            out = dict(self.counters)
        if self.store is not None:
            out["l3_write_queue_bytes"] = self._queued_bytes
        return out

    def _enqueue(self, item: tuple, size: int, dropped: str) -> bool:
        """Queue ``item`` unless its ``size`` would take the queue past ``write_queue_bytes``: then
        count it under ``dropped`` and return False at once (the engine thread never waits on L3)."""
        with self._queue_state:
            fits = self._queued_bytes + size <= self.write_queue_bytes
            if fits:
                self._queued_bytes += size
                self._queued_items += 1
        if not fits:
            self._count(dropped)
            return False
        self._writes.put((item, size))
        return True

    def _abandon_writes(self) -> None:
        """Drop every write still queued after ``close_timeout_s``: their pages stay out of L3."""
        abandoned = 0
        while True:
            try:
                _, size = self._writes.get_nowait()
            except queue.Empty:
                break
            self._write_done(size)
            abandoned += 1
        self._count("l3_writes_abandoned", abandoned)
        log.warning("KV tiers closing: the L3 store did not finish the queued writes within %.1f s; "
                    "abandoned %d (plus %d in progress); those pages are not in L3",
                    self.close_timeout_s, abandoned, self._queued_items)

    def _write_done(self, size: int) -> None:
        with self._queue_state:
            self._queued_bytes -= size
            self._queued_items -= 1
            self._queue_state.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self.counters[name] += n

    # ---- the threads -------------------------------------------------------------------------
    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            try:
                with self.order.copying(job.submitted):
                    for layer, event in enumerate(job.events):
                        for pages, part in job.copies.get(layer, ()):
                            scatter_layer(self.pool, layer, pages, part)
                        job.landed[layer] = self.order.landed()
                        event.set()
            except BaseException as exc:  # the waiting model step reports it
                job.error = self.broken = exc
                after = self.order.landed()  # whatever the failed job queued before it failed
                job.landed = [after if ev is None else ev for ev in job.landed]
                for event in job.events:
                    event.set()

    def _write_loop(self) -> None:
        assert self.store is not None
        while (entry := self._writes.get()) is not None:
            (op, what, full, swa), size = entry  # what: a page hash (put) or a chain of them (touch)
            try:
                if op == "put":
                    self._put(what, full, swa)
                else:
                    self.store.touch([store_key(h) for h in what])
                    self._count("l3_touches")
                    self._count("l3_touched_pages", len(what))
            except Exception:  # a cache tier may forget; the store counts its own errors
                self._count("l3_errors")
            finally:
                self._write_done(size)

    def _put(self, h: bytes, full: torch.Tensor, swa: torch.Tensor | None) -> None:
        """One page to the store; only a put the store kept marks the page written (a dropped one --
        store down, full, over its budget -- is retried at the page's next eviction)."""
        assert self.store is not None
        # A page without its SWA row never replaces one stored with it (another engine, or this one
        # before L2 forgot the page, saved it while its window was still held): the content is fixed
        # by the hash, so the entry there is at least as good -- when it reads back whole: the store
        # replaces a damaged one (a chain read stops at its first missing page, so the damaged pages
        # after it are never read, hence never removed, by a match; this put is where they are).
        if not self.store.put(store_key(h), encode_page(full, swa), keep_existing=swa is None):
            self._count("l3_puts_failed")
            return
        self._count("l3_puts")
        if self.on_written is not None:
            self.on_written(h, swa is not None)
