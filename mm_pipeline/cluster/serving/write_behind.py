"""One background thread that runs fire-and-forget writes in the order they were submitted.

The router's Redis writes (a prefix dispatched, a replica forgotten) come from Ray Serve's callbacks
on the router's event loop; a round trip there stalls every request routed through that ingress.
:class:`WriteBehind` takes them off the loop: ``submit`` appends to a bounded queue and returns, one
thread runs the queue first in, first out -- one thread, so a ``forget`` queued after a replica's
``record`` calls is never overtaken by them. The writes are hints (a lost one is a later miss), so a
full queue drops its oldest entry rather than block the caller or grow: counted in ``dropped`` and
logged at most once per ``log_every_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)


class WriteBehind:
    def __init__(self, name: str, max_pending: int = 4096, log_every_s: float = 10.0) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending, self.log_every_s = max_pending, log_every_s
        self.dropped = 0  # writes dropped because the queue was full
        self.failed = 0  # writes that raised (logged; the writer carries on)
        self._queue: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._busy = False  # the thread is running a write taken off the queue
        self._closing = False
        self._drain_until = float("inf")  # after close: give up on what is left at this time
        self._next_log = 0.0
        # daemon: Ray Serve has no router shutdown hook, so a process exit must not wait on Redis
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, write: Callable[[], None]) -> None:
        """Queue ``write``; never blocks beyond taking a lock. Dropped once closed."""
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self.max_pending:
                self._queue.popleft()  # the oldest: the newest dispatches are the likeliest to be asked for
                self.dropped += 1
                self._log_drop()
            self._queue.append(write)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._busy

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write queued so far has run (or been dropped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, drain_s: float = 1.0) -> None:
        """Stop taking writes, run what is queued for up to ``drain_s``, drop the rest, join the thread."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._drain_until = time.monotonic() + drain_s
                self._cond.notify_all()
        if self._thread is not threading.current_thread():
            # the write in flight may still wait out its socket timeout after the drain time
            self._thread.join(drain_s + 5.0)

    def _log_drop(self) -> None:  # under the lock
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + self.log_every_s
            log.warning("%s: write queue full (%d), dropping the oldest write; %d dropped so far",
                        self._thread.name, self.max_pending, self.dropped)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()  # wake flush()
                self._cond.wait_for(lambda: self._queue or self._closing)
                if self._closing and (not self._queue or time.monotonic() >= self._drain_until):
                    self.dropped += len(self._queue)
                    self._queue.clear()
                    self._cond.notify_all()
                    return
                write = self._queue.popleft()
                self._busy = True
            try:
                write()
            except Exception:  # a bug in one write must not stop every later one
                self.failed += 1
                log.exception("%s: a background write failed", self._thread.name)
