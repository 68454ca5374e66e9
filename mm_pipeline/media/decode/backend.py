r"""Where the pixels of a video chunk or an image are decoded: on the calling worker thread
(``ThreadDecodeBackend``) or in a pool of worker processes (``ProcessDecodeBackend``), whose
frames come back through one ``multiprocessing.shared_memory`` block per result.

    worker thread (WorkerPool)                         worker process (ProcessPoolExecutor)
    budget.reserve(bytes) ─► submit(job, block name) ─► limits checked from the header/plan
                             wait, polling control ──►   (frames x h x w, pixels, bytes) ─► decode
                             (cancel: flag in board)     ─► create block `name`, copy frames in
    copy block ─► unlink ◄── result (shape) ◄──────────┘ close (the parent owns the name)

The item's encoded bytes travel the other way in one block per item, shared by the jobs of that item
in flight and kept across its chunks by ``hold`` (input_blocks.py; a pipe would carry megabytes per
job). The parent names every block before the job starts, so it can unlink it whatever happens to
the worker: the waiting thread always sees the job end (a result, an error, a cancellation it waited
out, BrokenProcessPool after a worker died, CancelledError at shutdown) and then unlinks the name (a
no-op when it took the block already). Cancellation reaches a running job through one shared byte
per job in a small "cancel board" block the workers attach at start; the deadline travels as seconds
left.

Threads are the default: the GIL is held for ~4 % of a decode, and on the 2-core host processes
are slower in wall time at every worker count (README, "Overlap, measured": the 1/2/4-worker
table; docs/pipeline_measurements.md: the split).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing
import os
import secrets
import contextlib
import threading
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import Any, Protocol

import torch

from mm_pipeline.errors import ServerBusy, UndecodableMediaError
from mm_pipeline.media.decode.budget import DecodeControl
from mm_pipeline.media.decode.image import decode_image
from mm_pipeline.media.decode.input_blocks import InputBlocks
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import DecodedImage, MediaItem
from mm_pipeline.media.decode import worker_jobs as jobs
from mm_pipeline.media.decode.video_chunks import VideoContainers, decode_chunk, emit_groups

BACKENDS = ("thread", "process")


class DecodeWorkerDied(UndecodableMediaError):
    """A decode worker process died while decoding this item (twice): the file crashes the decoder."""


class DecodeBackend(Protocol):
    """Decodes video chunks and images; blocking, called on a WorkerPool thread. ``on_group``
    (video_chunks.decode_chunk) gets each group's frames; ``streams_groups``: while the chunk still
    decodes (else once it is done), which lets a chunk span GOPs without holding the encoder back.
    ``containers``: the video's open containers a chunk may borrow (video_chunks.VideoContainers)."""

    streams_groups: bool

    def decode_chunk(self, item: MediaItem, info: Any, indices: Sequence[int], groups: Sequence[int], tp: int,
                     limits: MediaLimits, size: tuple[int, int], control: DecodeControl | None = None,
                     threads: int = 1, on_group: Callable[[int, torch.Tensor], None] | None = None,
                     containers: VideoContainers | None = None) -> torch.Tensor: ...

    def decode_image(self, item: MediaItem, limits: MediaLimits, target: tuple[int, int] | None = None
                     ) -> DecodedImage: ...

    def hold(self, item: MediaItem) -> contextlib.AbstractContextManager[None]:
        """While the block runs, what the backend keeps per item for its jobs (the process backend's
        copy of the encoded bytes) outlives each job: a video's chunks decoded one after another
        share it. Entering and leaving copy, load and free nothing: fit for the event loop."""
        ...

    def shutdown(self) -> None: ...


class ThreadDecodeBackend:
    """The reference: decode on the calling thread (PyAV and PIL drop the GIL while decoding)."""

    streams_groups = True

    def decode_chunk(self, item: MediaItem, info: Any, indices: Sequence[int], groups: Sequence[int], tp: int,
                     limits: MediaLimits, size: tuple[int, int], control: DecodeControl | None = None,
                     threads: int = 1, on_group: Callable[[int, torch.Tensor], None] | None = None,
                     containers: VideoContainers | None = None) -> torch.Tensor:
        return decode_chunk(item, info, indices, groups, tp, limits, size, control, threads=threads,
                            on_group=on_group, containers=containers)

    def decode_image(self, item: MediaItem, limits: MediaLimits, target: tuple[int, int] | None = None
                     ) -> DecodedImage:
        return decode_image(item, limits, target=None if target is None else jobs.fixed_target(target))

    def hold(self, item: MediaItem) -> contextlib.AbstractContextManager[None]:
        return _NO_LOCK  # nothing is kept per item

    def shutdown(self) -> None:
        pass


def make_decode_backend(kind: str, workers: int) -> DecodeBackend:
    """``kind`` "thread" or "process" (``workers`` processes)."""
    if kind == "thread":
        return ThreadDecodeBackend()
    if kind == "process":
        return ProcessDecodeBackend(workers)
    raise ValueError(f"decode backend must be one of {BACKENDS}, got {kind!r}")


class ProcessDecodeBackend:
    """``workers`` processes (forkserver: no copy of the server's threads or CUDA state; torch
    uses one intra-op thread each). A pool broken by a dying worker is replaced, and each job it
    took down runs once more on the new pool: the job that crashes twice fails with
    ``DecodeWorkerDied``, the others complete."""

    POLL_S = 0.05  # how often a waiting thread looks at its control (deadline, cancellation)
    MAX_ATTEMPTS = 4  # pools a job may try when pools break under it (two deaths while it runs: the culprit)
    BOARD_SLOTS = 4096  # cancel flags; a job without a free slot still runs (cancelled at its deadline only)

    def __init__(self, workers: int, prefix: str = "mmsd") -> None:
        if workers < 1:
            raise ValueError(f"ProcessDecodeBackend needs workers >= 1, got {workers}")
        self.workers = workers
        self.prefix = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._retry_lock = threading.Lock()  # jobs run again after a worker died, one at a time
        self._board = shared_memory.SharedMemory(create=True, size=self.BOARD_SLOTS)
        self._board.buf[:] = bytes(self.BOARD_SLOTS)
        self._free_slots = list(range(self.BOARD_SLOTS))
        self._inputs = InputBlocks(self.prefix, self._names)
        self._closed = False
        self._executor = self._new_executor()
        self.restarts = 0  # pools replaced after a worker died
        self.warm(wait=False)

    # ---- public API -------------------------------------------------------------------------
    streams_groups = False  # the frames come back in one block per chunk

    def decode_chunk(self, item: MediaItem, info: Any, indices: Sequence[int], groups: Sequence[int], tp: int,
                     limits: MediaLimits, size: tuple[int, int], control: DecodeControl | None = None,
                     threads: int = 1, on_group: Callable[[int, torch.Tensor], None] | None = None,
                     containers: VideoContainers | None = None) -> torch.Tensor:
        # (``containers`` stay here: a worker process opens the bytes it was sent)
        frames = self._call(jobs.chunk_job, (item, info, list(indices), list(groups), tp, limits, size, threads),
                            control, f"a {item.format} video chunk from {item.origin}")
        if on_group is not None:
            emit_groups(frames, groups, tp, on_group)
        return frames

    def decode_image(self, item: MediaItem, limits: MediaLimits, target: tuple[int, int] | None = None
                     ) -> DecodedImage:
        pixels = self._call(jobs.image_job, (item, limits, target), None, f"the {item.format} image from {item.origin}")
        return DecodedImage(pixels, item.format)

    def hold(self, item: MediaItem) -> contextlib.AbstractContextManager[None]:
        return self._inputs.hold(item)

    def warm(self, wait: bool = True) -> None:
        """Start every worker now (each imports torch and PyAV: seconds), not on the first request."""
        futures = [self._executor.submit(jobs.noop) for _ in range(self.workers)]
        if wait:
            cf.wait(futures)

    def worker_pids(self) -> list[int]:
        """Process ids of the current pool's workers (benchmarks read their CPU time)."""
        with self._lock:
            return sorted(getattr(self._executor, "_processes", None) or {})

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor = self._executor
        executor.shutdown(wait=True, cancel_futures=True)
        self._board.close()
        self._board.unlink()
        self._inputs.close()

    # ---- internal helpers -------------------------------------------------------------------
    def _new_executor(self) -> cf.ProcessPoolExecutor:
        context = multiprocessing.get_context("forkserver")
        # the fork server imports torch, PyAV and the decoders once; each worker (and each
        # replacement after a crash) forks from it ready to decode
        context.set_forkserver_preload([jobs.__name__])
        return cf.ProcessPoolExecutor(self.workers, mp_context=context, initializer=jobs.init_worker,
                                      initargs=(self._board.name,))

    def _call(self, job: Callable[..., tuple[int, ...]], args: tuple, control: DecodeControl | None,
              what: str) -> torch.Tensor:
        # A worker died and took every job of its pool down: run them again one at a time on a
        # fresh pool. A job whose worker dies under it twice is the culprit; the others finish. A
        # pool that broke before the job reached it (CPython 3.11 can fail a submit to a pool that
        # is being torn down) does not count against the job.
        deaths = 0
        for attempt in range(self.MAX_ATTEMPTS):
            with self._retry_lock if attempt else _NO_LOCK:
                try:
                    return self._run_once(self._current(what), job, args, control, what)
                except _PoolBroke as broke:
                    self._replace(broke.executor)
                    deaths += broke.while_running
                    if deaths >= 2:
                        raise DecodeWorkerDied(f"the decode worker process died twice while decoding {what}; "
                                               f"the file crashes the decoder") from None
        raise DecodeWorkerDied(f"decoding {what}: the decode worker pool broke {self.MAX_ATTEMPTS} times in a row")

    def _current(self, what: str) -> cf.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise ServerBusy(f"decoding {what}: the decode processes are shut down")
            return self._executor

    def _run_once(self, executor: cf.ProcessPoolExecutor, job: Callable[..., tuple[int, ...]], args: tuple,
                  control: DecodeControl | None, what: str) -> torch.Tensor:
        name = f"{self.prefix}_{next(self._names)}"
        item: MediaItem = args[0]
        slot = self._take_slot()
        timeout_s = control.remaining_s if control is not None else None
        source = None
        try:
            source = self._inputs.share(item)
            try:
                future = executor.submit(job, name, slot, timeout_s, source, _without_bytes(item), *args[1:])
            except (cf.process.BrokenProcessPool, RuntimeError, OSError):  # broken, or replaced and shut down
                raise _PoolBroke(executor, while_running=False) from None
        except BaseException:
            self._give_slot(slot)
            if source is not None:
                self._inputs.release(item)
            raise
        try:
            try:
                shape = self._wait(executor, future, slot, control)
            except OSError as exc:  # CPython 3.11: a job waiting on a pool whose pipes another
                raise cf.process.BrokenProcessPool(str(exc)) from None  # thread's _stop closed
            return jobs.take_block(name, shape)
        except cf.process.BrokenProcessPool:
            _stop(executor)  # its processes are gone: none can create ``name`` later
            raise _PoolBroke(executor, while_running=True) from None
        except cf.CancelledError:
            raise ServerBusy(f"decoding {what}: the decode processes shut down") from None
        finally:
            jobs.unlink_block(name)  # a no-op when taken; else the job failed, was cancelled or its worker died
            self._give_slot(slot)
            self._inputs.release(item)

    def _wait(self, executor: cf.ProcessPoolExecutor, future: cf.Future, slot: int,
              control: DecodeControl | None) -> tuple[int, ...]:
        while True:
            try:
                return future.result(timeout=self.POLL_S)
            except cf.TimeoutError:
                if _pool_dead(executor):
                    raise cf.process.BrokenProcessPool("the pool's manager thread ended") from None
                if control is None:
                    continue
                try:
                    control.check()
                except BaseException:
                    self._cancel(slot)
                    future.cancel()
                    cf.wait([future])  # the job holds memory (the budget's bytes) until it stops
                    raise

    def _replace(self, broken: cf.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is not broken or self._closed:
                return  # another thread replaced it already
            self._executor = self._new_executor()
            self.restarts += 1

    def _take_slot(self) -> int:
        with self._lock:
            slot = self._free_slots.pop() if self._free_slots else -1
        if slot >= 0:
            self._board.buf[slot] = 0
        return slot

    def _give_slot(self, slot: int) -> None:
        if slot >= 0:
            with self._lock:
                self._free_slots.append(slot)

    def _cancel(self, slot: int) -> None:
        if slot >= 0:
            self._board.buf[slot] = 1


def _pool_dead(executor: cf.ProcessPoolExecutor) -> bool:
    # CPython 3.11 can leave a future pending for ever when a worker dies while the job is being
    # submitted (the manager thread fails the futures it knows of, then ends): seen in the crash
    # test, so a pending future whose pool has no manager any more counts as a broken pool.
    thread = getattr(executor, "_executor_manager_thread", None)
    return bool(getattr(executor, "_broken", False)) or (thread is not None and not thread.is_alive())


_STOP_LOCK = threading.Lock()


def _stop(executor: cf.ProcessPoolExecutor) -> None:
    """End a broken pool's processes and wait for them (a manager thread that died of an error
    leaves its workers running). Once per pool: every job of a broken pool comes here, and two
    concurrent shutdowns of one CPython 3.11 pool close its pipes twice (EBADF)."""
    with _STOP_LOCK:
        if getattr(executor, "_mmserve_stopped", False):
            return
        executor._mmserve_stopped = True
        processes = list((getattr(executor, "_processes", None) or {}).values())
        for process in processes:
            process.terminate()
        try:
            executor.shutdown(wait=True, cancel_futures=True)
        except OSError:  # its manager thread already closed a pipe of the broken pool
            pass
        for process in processes:
            process.join(5)


_NO_LOCK = contextlib.nullcontext()


def _without_bytes(item: MediaItem) -> MediaItem:
    """What a job carries of ``item``: a plain MediaItem without the bytes (they go through its
    block) and without the early decode (an object of this process). ``dataclasses.replace`` kept
    the class: a DeferredMediaItem (a repeated data URL or file whose units had left the encoder
    cache) refused bytes for its loader, and the request failed with a TypeError."""
    return MediaItem(item.kind, item.format, b"", item.origin, item.content_key)


class _PoolBroke(Exception):
    def __init__(self, executor: cf.ProcessPoolExecutor, *, while_running: bool) -> None:
        super().__init__("a decode worker process died")
        self.executor = executor
        self.while_running = while_running  # the job had reached the pool when it broke
