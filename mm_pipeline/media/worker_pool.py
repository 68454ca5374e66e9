"""Bounded off-loop execution of blocking work (decoding, hashing, disk I/O) with backpressure.

``await pool.run(fn, *args)`` runs ``fn`` on one of ``max_workers`` threads.  At most
``max_workers + max_pending`` calls are admitted at once; further callers wait (FIFO) for a slot,
so a burst of uploads queues on the event loop as cheap suspended coroutines instead of an
unbounded executor backlog of decoded frames.  ``admit_timeout_s`` turns a long wait into
``ServerBusy`` (HTTP 503).

``busy``: the workers using a CPU now -- running a call and not inside ``blocked()`` (a decode
waiting for room in the decode budget). The encoder's intra-op share follows it: a worker parked
on the budget leaves its core to the encoder, whose progress is what frees the budget.

Threads, not processes: PyAV and PIL drop the GIL while decoding, and results (frame tensors)
stay in-process without pickling; with ``decode_backend="process"`` a worker thread hands video
chunks and image pixels on to a worker process and waits (media/decode/backend.py).  The pool is usable
from any event loop and any thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import torch

from mm_pipeline.errors import ServerBusy

T = TypeVar("T")

_worker = threading.local()  # .pool: the WorkerPool whose call this thread runs now (else unset/None)


def _one_intra_op_thread() -> None:
    """A worker runs its torch ops (preprocessing, hashing) at one intra-op thread: the workers are
    the parallelism. At torch's setting each would start an OpenMP team of its own, more threads
    than cores beside the engine and encoder threads (runtime/thread_choice.py)."""
    torch.set_num_threads(1)


class WorkerPool:
    """Thread pool with an admission limit.

    Invariant (under ``_lock``): ``0 <= _admitted <= capacity``; a waiter is only woken by handing
    it a slot that stays counted in ``_admitted``; ``0 <= _blocked <= _running <= max_workers``."""

    def __init__(self, max_workers: int = 2, max_pending: int = 16, admit_timeout_s: float | None = None,
                 name: str = "media") -> None:
        if max_workers < 1 or max_pending < 0:
            raise ValueError(f"WorkerPool needs max_workers >= 1 and max_pending >= 0, got "
                             f"{max_workers}, {max_pending}")
        self.max_workers = max_workers
        self.capacity = max_workers + max_pending
        self.admit_timeout_s = admit_timeout_s
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix=f"{name}-worker",
                                            initializer=_one_intra_op_thread)
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0  # calls executing on a worker thread (admitted ones may still be queued)
        self._blocked = 0  # of those, inside ``blocked()``: waiting, using no CPU
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = (
            collections.deque()
        )

    # ---- public API -------------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on a worker thread; wait for admission first."""
        await self._acquire()
        try:
            cf: Future[T] = self._executor.submit(self._call, fn, args, kwargs)
        except BaseException:
            self._release()
            raise
        cf.add_done_callback(lambda _: self._release())
        return await asyncio.wrap_future(cf)

    @property
    def admitted(self) -> int:
        """Calls running or queued on the executor."""
        with self._lock:
            return self._admitted

    @property
    def busy(self) -> int:
        """Workers using a CPU now: running a call, not blocked (module doc). ``admitted`` counts
        a worker waiting for the decode budget too, and queued calls."""
        with self._lock:
            return self._running - self._blocked

    @property
    def waiting(self) -> int:
        """Callers suspended for admission."""
        with self._lock:
            return sum(1 for _, fut in self._waiters if not fut.done())

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def check_integrity(self) -> None:
        with self._lock:
            if not 0 <= self._admitted <= self.capacity:
                raise AssertionError(f"admitted {self._admitted} outside [0, {self.capacity}]")
            if not 0 <= self._blocked <= self._running <= self.max_workers:
                raise AssertionError(f"{self._blocked} blocked of {self._running} running workers "
                                     f"(at most {self.max_workers})")

    # ---- internal helpers -------------------------------------------------------------------

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """On a worker thread: ``fn`` counted as running, the thread marked as this pool's worker
        (``blocked()`` finds the pool there)."""
        with self._lock:
            self._running += 1
        _worker.pool = self
        try:
            return fn(*args, **kwargs)
        finally:
            _worker.pool = None
            with self._lock:
                self._running -= 1

    async def _acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._admitted < self.capacity and not self._waiters:
                self._admitted += 1
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.admit_timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError) as exc:
            with self._lock:
                try:
                    self._waiters.remove((loop, fut))
                    queued = True
                except ValueError:
                    queued = False  # a slot was handed to us (or is on its way) — give it back
            if not queued:
                if fut.done() and not fut.cancelled():
                    self._release()
                else:
                    fut.cancel()  # _grant sees the cancellation and releases the slot
            if isinstance(exc, asyncio.TimeoutError):
                raise ServerBusy(f"media worker pool saturated ({self.capacity} calls admitted) for "
                                 f"{self.admit_timeout_s} s") from None
            raise

    def _release(self) -> None:
        with self._lock:
            if self._waiters:
                loop, fut = self._waiters.popleft()  # the slot passes to this waiter
            else:
                self._admitted -= 1
                return
        try:
            loop.call_soon_threadsafe(self._grant, fut)
        except RuntimeError:  # the waiter's loop is closed: nobody will take the slot
            self._release()

    def _grant(self, fut: asyncio.Future[None]) -> None:
        if fut.done():  # cancelled or timed out after it left the queue
            self._release()
        else:
            fut.set_result(None)


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """The calling thread waits, using no CPU, for the block (a decode waiting for room in the
    decode budget): if it runs a WorkerPool's call, that pool's ``busy`` leaves it out meanwhile.
    Elsewhere (a test's thread, the event loop) it does nothing."""
    pool: WorkerPool | None = getattr(_worker, "pool", None)
    if pool is None:
        yield
        return
    with pool._lock:
        pool._blocked += 1
    try:
        yield
    finally:
        with pool._lock:
            pool._blocked -= 1
