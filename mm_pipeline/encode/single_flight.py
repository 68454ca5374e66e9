"""SingleFlight: concurrent requests for one content key share one computation.

    join(key, waiter) ──key idle──► True:  the caller now computes, then finish(key, value | error)
           │                               (nobody else will: the key is claimed until finish)
           └──key in flight──► False: the waiter is called with the first caller's result
    finish(key, ...)  removes the key, then calls every waiter still joined: (value, None) or (None, error)
    leave(key, waiter)  a waiter whose request ended gets nothing (the computation goes on)

Used for encoder units (``EncoderBatcher``: waiters are the requests' stream sinks, called on the
engine thread) and for media planning (``MediaPlanner`` through :meth:`SingleFlight.run`, the asyncio
form: the first caller starts the computation as a task of its own, and every caller awaits its
result; it is cancelled only once no caller waits any more).

Invariant (under ``_lock``): a key is present from its claim until ``finish``; every waiter of a
present key is called exactly once, by ``finish``, unless it left first (a waiter that raises is
logged; the others are still called). A key is never left behind:
``run``'s computation finishes its key on success and on failure; one cancelled because nobody
waits any more released its key when it was cancelled (so a new caller never joins a dying one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable, Generic, Optional, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
Waiter = Callable[[Optional[T], Optional[BaseException]], None]  # (value, None) or (None, error)


class SingleFlight(Generic[T]):
    """Content key -> the waiters of its one in-flight computation (thread-safe)."""

    def __init__(self, abandoned: Callable[[], Exception] = lambda: RuntimeError("computation was cancelled")
                 ) -> None:
        """``abandoned`` makes the error joined waiters get when ``run``'s computing caller is
        cancelled (a ``CancelledError`` belongs to the cancelled task, not to the others)."""
        self._abandoned = abandoned
        self._lock = threading.Lock()
        self._waiters: dict[str, list[Waiter[T]]] = {}
        self._tasks: dict[str, tuple[asyncio.Task, Callable[[], None] | None]] = {}  # run(): key -> computation

    # ---- callback form ----------------------------------------------------------------------
    def join(self, key: str, waiter: Waiter[T]) -> bool:
        """Register ``waiter`` for ``key``. True: the key was idle and the caller must now compute
        it and call :meth:`finish`; False: it joined the computation already in flight."""
        with self._lock:
            waiters = self._waiters.get(key)
            if waiters is None:
                self._waiters[key] = [waiter]
                return True
            waiters.append(waiter)
            return False

    def leave(self, key: str, waiter: Waiter[T]) -> None:
        """``waiter`` gets nothing more; the computation itself still finishes (the key stays
        claimed until :meth:`finish`, even with no waiter left)."""
        with self._lock:
            waiters = self._waiters.get(key)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)

    def finish(self, key: str, value: T | None = None, error: BaseException | None = None) -> None:
        """End ``key``'s computation: release the key, then give every waiter ``value`` or
        ``error`` (outside the lock: a waiter may join again). Finishing an idle key does nothing."""
        with self._lock:
            waiters = self._waiters.pop(key, [])
        for waiter in waiters:
            try:
                if error is not None:
                    waiter(None, error)
                else:
                    waiter(value, None)
            except Exception:  # one waiter's failure (its event loop closed) must not starve the rest
                log.exception("a waiter of %s failed", key[:16])

    def wanted(self, key: str) -> bool:
        """Does any waiter still wait for ``key``? (a computation nobody wants may stop early)"""
        with self._lock:
            return bool(self._waiters.get(key))

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._waiters

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiters)

    # ---- asyncio form -----------------------------------------------------------------------
    async def run(self, key: str, compute: Callable[[], Awaitable[T]],
                  abandon: Callable[[], None] | None = None) -> tuple[T, bool]:
        """``(value, computed)``: the first caller for ``key`` starts ``compute()`` (``computed``
        True); callers arriving meanwhile await that result (False) or its exception. The
        computation is a task of its own, not a part of the first caller: any caller cancelled
        (its client went away) leaves alone, and only when the last one has left is the task
        cancelled and ``abandon()`` called (e.g. stop a worker thread's decode); joiners then
        get ``abandoned()``. Joiners may run on other event loops than the computing caller."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()

        def settle(value: T | None, error: BaseException | None) -> None:
            if result.done():  # a caller cancelled meanwhile has a cancelled future
                return
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(value)  # type: ignore[arg-type]

        def waiter(value: T | None, error: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # that caller's loop is closed: nobody is left to tell
                pass

        computing = self.join(key, waiter)
        if computing:
            task = loop.create_task(compute())
            with self._lock:
                self._tasks[key] = (task, abandon)
            task.add_done_callback(lambda t: self._computed(key, t))
        try:
            return await result, computing
        except asyncio.CancelledError:
            self.leave(key, waiter)
            self._stop_if_unwanted(key)
            raise

    def _computed(self, key: str, task: asyncio.Task) -> None:
        with self._lock:
            if self._tasks.get(key, (None,))[0] is not task:
                return  # stopped as unwanted: its key was released then, and may be another's now
            del self._tasks[key]
        if task.cancelled():
            self.finish(key, error=self._abandoned())
        elif task.exception() is not None:
            self.finish(key, error=task.exception())
        else:
            self.finish(key, task.result())

    def _stop_if_unwanted(self, key: str) -> None:
        """Cancel ``key``'s computation once no caller waits for it any more, and release the key
        at once: a caller arriving while the cancellation is under way starts a computation of its
        own, where joining the dying one would hand it the ``abandoned()`` error."""
        with self._lock:
            if self._waiters.get(key) or key not in self._tasks:
                return
            task, abandon = self._tasks.pop(key)
            del self._waiters[key]  # empty: nobody waits on the cancelled computation
        task.get_loop().call_soon_threadsafe(task.cancel)
        if abandon is not None:
            abandon()

    def check_integrity(self) -> None:
        """Call when idle: no computation is in flight, so no key may be left claimed."""
        with self._lock:
            if self._waiters or self._tasks:
                raise AssertionError(f"keys left in flight: {sorted({*self._waiters, *self._tasks})[:5]}")
