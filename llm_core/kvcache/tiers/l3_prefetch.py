"""L3 reads off the engine thread: a request's pages past L1 + L2 are fetched by a fetch thread
while the request waits (not scheduled) and every other request keeps stepping.

    engine thread (schedule)                         fetch threads
    start(request, wanted) ──► FetchJob ──► _jobs ──► store.get + decode, page by page (chain order)
    ready(request)?  False while the job runs         job.pages[h] = (full, swa) | None
                     True when it is done, or after ``timeout_s`` (the job is cancelled and the
                     match uses what arrived: SGLang HiCache's "timeout" prefetch policy)
    match ──► take(request) ──► staged pages (bounded, LRU) ──► KVTiers._lookup: L2, then staged

Nothing here touches the tree or the pools; KVTiers decides which pages to fetch and uses them.
A page that arrives after the timeout is still staged for the next request with that prefix.

Staging keeps a chain usable: a job stages its pages in chain order and, when the next one would
only fit by evicting the job's own earlier pages, stops there (a chain past L1 is only usable up to
its first gap, so evicting its head for its tail would leave nothing). Other jobs' pages go first,
least recently used first. ``take`` hands the rows over to the staged area and the job keeps none:
the match copies them into L1 right after, so a running request holds no host rows for its decode
and what the prefetcher holds is what ``staged_bytes`` bounds (plus pages still arriving).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from llm_core.engine.request import Request
from llm_core.kvcache.tiers.page_format import store_key
from llm_core.storage import KeyValueStore

DecodedPage = tuple[torch.Tensor, "torch.Tensor | None"]  # (Full row, SWA row or None)


@dataclass
class FetchJob:
    """L3 reads for one request. ``wanted``: (page hash, whether a miss ends the job: past L1 a
    chain is only usable up to its first missing page)."""

    wanted: list[tuple[bytes, bool]]
    started: float
    pages: dict[bytes, DecodedPage | None] = field(default_factory=dict)  # arrived, not staged yet
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    staged: set[bytes] = field(default_factory=set)  # its pages in the staged area: never evicted for its own
    full: bool = False  # the staged area had no room for its next page: later ones would follow a gap


class L3Prefetcher:
    """Fetch jobs per request, their thread, and the staged pages they brought (at most
    ``staged_bytes``, least recently used dropped first). Engine-thread methods: start, ready,
    take, forget, in_flight; the threads only read the store."""

    def __init__(self, store: KeyValueStore, decode: Callable[[bytes], DecodedPage | None], timeout_s: float,
                 staged_bytes: int = 256 << 20, num_threads: int = 4) -> None:
        """``num_threads`` fetch threads, each reading one job's pages in chain order, so one long
        chain does not hold up the others' reads."""
        if timeout_s < 0:
            raise ValueError(f"the L3 load timeout must be >= 0 s, got {timeout_s}")
        self.store, self.decode, self.timeout_s, self.staged_bytes = store, decode, timeout_s, staged_bytes
        self.counters: Counter[str] = Counter()
        self._count_lock = threading.Lock()  # the fetch threads count too
        self._jobs: dict[Request, FetchJob] = {}
        self._staged: OrderedDict[bytes, DecodedPage] = OrderedDict()
        self._staged_nbytes = 0
        self._queue: queue.Queue[FetchJob | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._fetch_loop, name=f"kv-l3-fetch-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    # ---- engine thread -------------------------------------------------------------------------
    def has(self, h: bytes) -> bool:
        return h in self._staged

    def started(self, request: Request) -> bool:
        return request in self._jobs

    def start(self, request: Request, wanted: list[tuple[bytes, bool]]) -> None:
        """Queue the reads of ``wanted`` for ``request`` (an empty list makes a job that is done)."""
        job = FetchJob(wanted, time.monotonic())
        self._jobs[request] = job
        if wanted:
            self.counters["l3_fetches"] += 1
            self._queue.put(job)
        else:
            job.done.set()

    def ready(self, request: Request) -> bool:
        """Whether ``request`` may be matched now: its job is done, or it has waited ``timeout_s``."""
        job = self._jobs.get(request)
        if job is None or job.done.is_set() or job.cancelled:
            return True
        if time.monotonic() - job.started < self.timeout_s:
            return False
        job.cancelled = True  # the thread stops at the next page; what arrived is used
        self.counters["l3_fetch_timeouts"] += 1
        return True

    def take(self, request: Request) -> None:
        """Stage what ``request``'s job brought so far (called by the match, which loads the staged
        rows into L1); the job lets go of them."""
        job = self._jobs.get(request)
        if job is not None:
            self._stage_job(job)

    def get(self, h: bytes) -> DecodedPage | None:
        page = self._staged.get(h)
        if page is not None:
            self._staged.move_to_end(h)
        return page

    def forget(self, request: Request) -> None:
        """The request let go of its match (finished, preempted, or unmatched): stop its job."""
        job = self._jobs.pop(request, None)
        if job is not None:
            self._stage_job(job)
            job.cancelled = True

    def in_flight(self) -> int:
        """Requests whose L3 reads are running now (the stats' ``l3_loads_in_flight``)."""
        return sum(1 for j in self._jobs.values() if not (j.done.is_set() or j.cancelled))

    def _stage_job(self, job: FetchJob) -> None:
        """Move the job's arrived pages, in chain order, into the staged area, up to the first that
        does not fit beside the job's earlier ones; the job keeps no rows either way."""
        job.staged.intersection_update(self._staged)  # other jobs may have evicted some since the last time
        kept = sum(_nbytes(self._staged[h]) for h in job.staged)
        for h in list(job.pages):  # the thread may still be adding to it (after a timeout)
            page = job.pages.pop(h)
            if page is None or job.full:
                continue
            size = _nbytes(self._staged.get(h, page))
            if kept + size > self.staged_bytes:
                job.full = job.cancelled = True  # the rest of its chain would follow a gap: stop reading
                self.counters["l3_staging_full"] += 1
                continue
            self._stage(h, page, size, job.staged)
            job.staged.add(h)
            kept += size

    def _stage(self, h: bytes, page: DecodedPage, size: int, keep: set[bytes]) -> None:
        """Stage ``page`` as the most recently used, evicting the least recently used pages not in
        ``keep`` (the caller checked that ``keep`` and ``page`` fit)."""
        if h in self._staged:
            self._staged.move_to_end(h)
            return
        while self._staged_nbytes + size > self.staged_bytes:
            old = next(iter(self._staged))
            if old in keep:
                self._staged.move_to_end(old)  # in chain order, so the chain stays in order too
            else:
                self._staged_nbytes -= _nbytes(self._staged.pop(old))
        self._staged[h] = page
        self._staged_nbytes += size

    def stop(self) -> None:
        for job in self._jobs.values():
            job.cancelled = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)

    # ---- the fetch threads ---------------------------------------------------------------------
    def _fetch_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                for h, ends_chain in job.wanted:
                    if job.cancelled:
                        break
                    raw = self.store.get(store_key(h))
                    page = self.decode(raw) if raw is not None else None
                    if raw is not None and page is None:  # whole for the store, not a page of this model
                        # removed so that the page's next save replaces it -- unless a save already did
                        # since the read (this process's writer, another process): that one stays
                        self.store.delete_unless_changed(store_key(h), raw)
                        with self._count_lock:
                            self.counters["l3_rejected"] += 1
                    job.pages[h] = page
                    if page is None and ends_chain:
                        break
            except Exception:  # a cache tier may fail; the request goes on with what arrived
                with self._count_lock:
                    self.counters["l3_fetch_errors"] += 1
            finally:
                job.done.set()


def _nbytes(page: DecodedPage) -> int:
    return sum(t.numel() * t.element_size() for t in page if t is not None)
