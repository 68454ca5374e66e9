"""The encoder worker: encoder batches on their own thread, beside the engine thread's LLM steps.

    engine thread   ── step ── step ── step ── step ──►   (prefill of groups 0..k as they land)
    encoder worker  ─ encode g0 ─ encode g1 ─ encode g2 ─►  (rows -> cache + sinks -> frontier)

With the encoder inline (``encoder_worker=False``) the engine thread alternates the two, so the
encoding of frame group k+1 waits for the prefill step of group k and vice versa; here each thread
runs as soon as its own work is ready. Tokens do not change: rows reach the request's
``EmbeddingStream`` the same way and the scheduler only ever reads rows that have arrived.

Threads (CPU): each thread applies its own intra-op share on that thread alone
(``intra_op.set_local_threads``: OpenMP's per-thread count and MKL's thread-local one; torch's
``set_num_threads`` would also hand the value to every thread that has not run a parallel op yet).
The split is a share of the cores, not a hard partition: the engine thread sets ``llm_threads`` and
this worker ``encoder_threads``, each once at its start (``split_threads``); beside a CPU LLM on
``auto`` the lanes run at one each (the engine thread's team is the process's one: thread_choice.py).
Or the worker follows the decoders
(``threads`` a callable, ``encoder_threads`` 0): before every batch it takes the CPUs the busy
decode workers leave free, so it stays out of their way while a video decodes and the encoding
left when decoding ends (the critical path of a long video) gets every core:

    decode workers busy   2 2 2 2 2 2 1 0 0
    encoder threads       1 1 1 1 1 1 1 2 2     (2 CPUs)

Lanes (CPU, ``lanes`` > 1): several encoder threads run batches side by side, the encoder's thread
share divided among them (on 2 cores: two lanes at one intra-op thread each, the most efficient
GEMMs on that host). Each takes at most its share of the queue (``EncoderBatcher.run_due(lanes=...)``),
and lane k > 0 only while the decode workers leave it a CPU (``spare``: k < CPUs - busy decode
workers), so while a video decodes one lane encodes (in larger batches, out of the decoders' way:
they are the critical path then) and the frame groups left when decoding ends are encoded on every
core at once instead of by one thread while the engine thread waits for their rows:

    decode workers busy   2 2 2 2 2 1 0 0
    lanes encoding        1 1 1 1 1 1 2 2     (2 CPUs)

A job leaves the queue under the batcher's lock, so no unit is encoded twice. A CUDA encoder always
has one lane (its one stream).

CUDA: the encoder runs on its own stream; after a forward the worker waits for that stream (only
this thread blocks) before the rows are delivered, so the LLM's stream never reads half-written rows
while its prefill kernels keep running; the media workers hand it finished patch rows the same way
(encode/device_streams.py has both rules and the allocator's).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

import torch

from mm_pipeline.encode.batcher import EncoderBatcher
from mm_pipeline.encode.device_streams import read_by
from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads

log = logging.getLogger(__name__)


def split_threads(total: int, encoder_threads: int) -> tuple[int, int]:
    """(llm threads, encoder threads) out of ``total`` intra-op threads. ``encoder_threads`` 0:
    half each (rounded in the LLM's favour), at least one each; otherwise as given, the LLM keeps
    the rest (at least one)."""
    if total < 1 or encoder_threads < 0:
        raise ValueError(f"split_threads needs total >= 1 and encoder_threads >= 0, got {total}, {encoder_threads}")
    enc = encoder_threads or max(1, total // 2)
    return max(1, total - enc), enc


def free_cpu_threads(total: int, busy: Callable[[], int]) -> Callable[[], int]:
    """The encoder's share when it follows the decoders: ``total`` minus the ``busy()`` decode
    workers, at least 1."""
    if total < 1:
        raise ValueError(f"free_cpu_threads needs total >= 1, got {total}")
    return lambda: max(1, total - busy())


def default_threads() -> int:
    """The intra-op threads the process would use: torch's setting, capped by the CPUs we may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cpus))


def lane_threads(share: int, lanes: int) -> int:
    """One lane's intra-op threads: the encoder's ``share`` divided among ``lanes``, at least 1."""
    return max(1, share // lanes)


class EncoderWorker:
    """Owns the thread(s) that run ``batcher.run_due()``; ``wake`` on every submit."""

    def __init__(self, batcher: EncoderBatcher, device: torch.device | str = "cpu",
                 threads: int | Callable[[], int] | None = None, idle_wait_s: float = 0.05,
                 lanes: int = 1, spare: Callable[[], int] | None = None, spare_poll_s: float = 0.003) -> None:
        """``threads`` (CPU): the encoder's intra-op share -- a fixed count set once, a callable read
        before every batch (``free_cpu_threads``), or None (torch's setting) -- divided among
        ``lanes`` threads (module doc; a CUDA encoder has one lane). ``spare``: the CPUs the busy
        decode workers leave (None: every lane always runs); a lane held back looks again every
        ``spare_poll_s`` while work is queued (a decode worker finishing wakes nobody)."""
        if lanes < 1:
            raise ValueError(f"EncoderWorker needs lanes >= 1, got {lanes}")
        self.batcher = batcher
        self.device = torch.device(device)
        self.threads = threads
        self.idle_wait_s = idle_wait_s
        self.lanes = lanes if self.device.type == "cpu" else 1
        # lane k > 0 takes work only while k < spare()
        self.spare = spare if self.lanes > 1 else None
        self.spare_poll_s = spare_poll_s
        # the count each lane sets at its start (None: none set); read here, on the constructing
        # thread: a new thread's torch.get_num_threads() is the last count any thread set
        share = threads if isinstance(threads, int) else default_threads() if threads is None and self.lanes > 1 else None
        self._start_threads = lane_threads(share, self.lanes) if share is not None and self.device.type == "cpu" else None
        # thread_changes: how often a followed share changed
        self.counts = {"encoder_units": 0, "encoder_runs": 0, "encoder_errors": 0, "thread_changes": 0}
        self._counts_lock = threading.Lock()  # lanes count side by side
        self.threads_used: int | None = None  # the intra-op count a lane last set
        self.busy_lanes = 0  # lanes inside a batch now (the engine thread's StepThreads reads it)
        self._lane_threads: list[int | None] = [None] * self.lanes
        self._wakes = [threading.Event() for _ in range(self.lanes)]
        self._stop = False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True,
                                          name="omni-encoder" if k == 0 else f"omni-encoder-{k}")
                         for k in range(self.lanes)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def wake(self) -> None:
        for w in self._wakes:
            w.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self.wake()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    def deliver_ready(self, rows: Sequence[torch.Tensor]) -> None:
        """CUDA, before a forward's rows are delivered: wait (this thread only) until the encoder
        stream's work is done, and mark the rows as read by the device's default stream, where the
        LLM's prefill reads them (encode/device_streams.py)."""
        if self._stream is not None:
            self._stream.synchronize()
            read_by(rows, torch.cuda.default_stream(self.device))

    @property
    def alive(self) -> bool:
        """Every lane's thread runs."""
        return all(t.is_alive() for t in self._threads)

    def _run(self, lane: int) -> None:
        if self._start_threads is not None:
            self._set_threads(lane, self._start_threads)
        elif callable(self.threads) and self.device.type == "cpu":
            # asked once now too: a measured share (thread_choice.ProbedThreads) is measured on the
            # first lane at its start, the other lanes wait for that choice and take their part of it
            self._set_threads(lane, lane_threads(self.threads(), self.lanes))
        wake = self._wakes[lane]
        while not self._stop:
            wake.clear()  # before looking: a submit after this wakes the next wait
            try:
                n = self._run_due(lane)
            except Exception:  # a bug must not kill encoding; the batcher already failed the units
                log.exception("encoder worker iteration failed")
                self._count(encoder_errors=1)
                n = 0
                time.sleep(0.01)
            if n:
                self._count(encoder_units=n, encoder_runs=1)
                continue
            due = self.batcher.next_due()
            wait = self.idle_wait_s if due is None else max(0.0, min(self.idle_wait_s, due - time.monotonic()))
            if n is None:  # held back while the decoders are busy: nothing wakes it when they finish
                wait = self.spare_poll_s
            if wait > 0:
                wake.wait(wait)

    def _count(self, **add: int) -> None:
        with self._counts_lock:
            for name, n in add.items():
                self.counts[name] += n

    def _set_threads(self, lane: int, n: int) -> None:
        if n != self._lane_threads[lane]:
            set_local_threads(n)  # this thread's OpenMP team and MKL count alone; cheap, and only on a change
            if self._lane_threads[lane] is not None:
                self._count(thread_changes=1)
            self._lane_threads[lane] = self.threads_used = n

    def _run_due(self, lane: int) -> int | None:
        """Units encoded; None: this lane is held back (the decoders leave it no CPU)."""
        if self.spare is not None and lane > 0 and self.batcher.next_due() is not None and lane >= self.spare():
            return None
        if callable(self.threads) and self.device.type == "cpu" and self.batcher.next_due() is not None:
            self._set_threads(lane, lane_threads(self.threads(), self.lanes))
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                return self.batcher.run_due()
        self._count_busy(1)
        try:
            return self.batcher.run_due(lanes=self.lanes)
        finally:
            self._count_busy(-1)

    def _count_busy(self, d: int) -> None:
        with self._counts_lock:
            self.busy_lanes += d
