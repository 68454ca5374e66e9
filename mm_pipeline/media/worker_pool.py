"""Bounded off-loop execution of blocking work (decoding, hashing, disk I/O) with backpressure.

``await pool.run(fn, *args)`` runs ``fn`` on one of ``max_workers`` threads (``spare`` more for
requests that have no call running, below).  At most
``max_workers + max_pending`` calls are admitted at once; further callers wait for a slot (the
more urgent priority first, FIFO within one: ``flows.Admission``), so a burst of uploads queues on
the event loop as cheap suspended coroutines instead of an unbounded executor backlog of decoded
frames.  ``admit_timeout_s`` turns a long wait into ``ServerBusy`` (HTTP 503).

``busy``: the workers using a CPU now -- running a call and not inside ``blocked()`` (a decode
waiting for room in the decode budget). The encoder's intra-op share follows it: a worker parked
on the budget leaves its core to the encoder, whose progress is what frees the budget.

Fair between requests. Calls carry the flow (a request) that made them (``flows.flow(key)``: a
context variable the request's tasks inherit). A free worker starts a queued call of the flow with
the fewest calls running; among equals, round-robin (``flows.Turns``, a start being a service: the
one served longest ago, a newcomer just before the one served last; none starves);
FIFO within a flow; and before all that, a flow of more urgent priority first (the request's, under
the engine's ``priority`` queue policy). ``spare`` extra threads start only calls of flows that have
none running.

Why: a long video queues dozens of chunk decodes at once; with one FIFO an image request sent
just after it waited for all of them, once for each of its own calls (ingest, plan, cache lookup,
decode); fair order alone still makes each of those wait for a chunk to end, hence the spare
(README, "Requests take turns in the media workers", has the measurements). The executor's queue holds
interchangeable "start what may start" turns (at most one per thread), and a thread whose call ends
goes on starting calls while one may start, so the choice is made when a worker frees up.
``shutdown`` refuses new calls first, so none is queued behind the last thread.

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
from collections.abc import Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from mm_pipeline.errors import ServerBusy
from mm_pipeline.media.flows import Admission, Turns, current_flow

T = TypeVar("T")

_worker = threading.local()  # .pool: the WorkerPool whose call this thread runs now (else unset/None)
@dataclass(eq=False)
class _FlowState:
    """A flow with calls queued or started (its round-robin rank: ``WorkerPool._turns``)."""

    priority: int
    started: int = 0


@dataclass(eq=False)
class _Call:
    """An admitted call waiting for a worker: what to run and the future its caller awaits."""

    flow: Hashable | None
    priority: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: Future


def _one_intra_op_thread() -> None:
    """A worker runs its torch ops (preprocessing, hashing) at one intra-op thread: the workers are
    the parallelism. At torch's setting each would start an OpenMP team of its own, more threads
    than cores beside the engine and encoder threads (runtime/cpu_threads/thread_choice.py)."""
    torch.set_num_threads(1)


class WorkerPool:
    """Thread pool with an admission limit, fair between flows (module doc).

    Invariants (under ``_lock``): ``0 <= _blocked <= _started <= max_workers + spare``, and
    ``_started`` calls beyond ``max_workers`` only of flows that had none running when they
    started. Admission keeps its own (``flows.Admission``): a call holds its slot from before it is
    queued until it returned or was dropped."""

    def __init__(self, max_workers: int = 2, max_pending: int = 16, admit_timeout_s: float | None = None,
                 name: str = "media", spare: int = 0) -> None:
        if max_workers < 1 or max_pending < 0 or spare < 0:
            raise ValueError(f"WorkerPool needs max_workers >= 1, max_pending >= 0 and spare >= 0, got "
                             f"{max_workers}, {max_pending}, {spare}")
        self.max_workers = max_workers
        self.spare = spare
        self.capacity = max_workers + max_pending
        self.admit_timeout_s = admit_timeout_s
        self._executor = ThreadPoolExecutor(max_workers + spare, thread_name_prefix=f"{name}-worker",
                                            initializer=_one_intra_op_thread)
        # its own lock: no step of the pool changes admission and the queues together
        self._admission = Admission(self.capacity, admit_timeout_s)
        self._lock = threading.Lock()
        self._started = 0  # calls taken by a worker thread, not returned yet (what ``busy`` counts)
        self._blocked = 0  # of those, inside ``blocked()``: waiting, using no CPU
        # admitted calls not started yet, per flow (a flow with none is not a key)
        self._ready: dict[Hashable | None, collections.deque[_Call]] = {}
        self._flows: dict[Hashable | None, _FlowState] = {}  # those with calls queued or started
        self._turns = Turns()  # their round-robin ranks (a start is a service)
        # ``_work`` turns submitted to the executor and not begun: one is submitted per queued call
        # while turns and started calls leave a thread free, so at most one per thread waits there
        self._tokens = 0
        self._closed = False

    # ---- public API -------------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on a worker thread; wait for admission first."""
        key, priority = current_flow()
        try:
            await self._admission.acquire(priority)
        except asyncio.TimeoutError:
            raise ServerBusy(f"media worker pool saturated ({self.capacity} calls admitted) for "
                             f"{self.admit_timeout_s} s") from None
        cf: Future[T] = Future()
        call = _Call(key, priority, fn, args, kwargs, cf)
        turn = False
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("cannot run calls on a worker pool that was shut down")
                self._ready.setdefault(call.flow, collections.deque()).append(call)
                if call.flow not in self._flows:  # (a flow keeps the priority it came with)
                    self._flows[call.flow] = _FlowState(call.priority)
                    self._turns.arrive(call.flow)
                turn = self._started + self._tokens < self.max_workers + self.spare
                self._tokens += turn
            if turn:  # else every thread runs a call or has a turn coming, and each goes on to this one
                self._executor.submit(self._work)
        except BaseException:
            with self._lock:
                self._tokens -= turn
                self._unqueue(call.flow, cf)
            cf.cancel()
            self._admission.release()
            raise
        key = call.flow

        def done(f: Future) -> None:  # holds the flow, not the call: no cycle keeping f's result alive
            if f.cancelled():  # its caller gave up (wrap_future passes the cancel on): off the queue now,
                with self._lock:  # its arguments (a request's media bytes) with it, not on its turn
                    self._unqueue(key, f)
            self._admission.release()

        cf.add_done_callback(done)
        return await asyncio.wrap_future(cf)

    @property
    def admitted(self) -> int:
        """Calls running or queued for a worker."""
        return self._admission.admitted

    @property
    def busy(self) -> int:
        """Workers using a CPU now: running a call, not blocked (module doc). ``admitted`` counts
        a worker waiting for the decode budget too, and queued calls."""
        with self._lock:
            return self._started - self._blocked

    @property
    def waiting(self) -> int:
        """Callers suspended for admission."""
        return self._admission.waiting

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers; ``wait=False`` cancels the calls not started yet (their callers see
        CancelledError), ``wait=True`` runs them first."""
        with self._lock:  # no call is queued from now on: one queued after the cancels below would hang
            self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:  # wait=True ran them all; wait=False leaves those no thread had started
            queued = [call for calls in self._ready.values() for call in calls]
            for call in queued:
                self._unqueue(call.flow, call.future)
        for call in queued:
            call.future.cancel()

    def check_integrity(self) -> None:
        self._admission.check_integrity()
        with self._lock:
            if not 0 <= self._blocked <= self._started <= self.max_workers + self.spare:
                raise AssertionError(f"{self._blocked} blocked of {self._started} started calls (at most "
                                     f"{self.max_workers} + {self.spare} spare)")
            per_flow = {k: f.started for k, f in self._flows.items()}
            if sum(per_flow.values()) != self._started or min(per_flow.values(), default=0) < 0:
                raise AssertionError(f"per-flow started counts {per_flow} do not add up to {self._started}")
            if not 0 <= self._tokens <= self.max_workers + self.spare and not self._closed:
                raise AssertionError(f"{self._tokens} turns waiting for {self.max_workers + self.spare} threads")
            if any(not calls for calls in self._ready.values()):
                raise AssertionError("a flow with no queued call is still listed as ready")
            if set(self._flows) != set(self._ready) | {k for k, f in self._flows.items() if f.started}:
                raise AssertionError("the flows remembered are not those with calls queued or started")
            if len(self._turns) != len(self._flows) or any(k not in self._turns for k in self._flows):
                raise AssertionError("the flows ranked are not those remembered")

    # ---- internal helpers -------------------------------------------------------------------

    def _work(self) -> None:
        """On a worker thread (a turn ``run`` submitted): start calls while one may start. A call
        whose caller gave up is skipped. ``_take`` finds nothing only when calls are running (at
        least ``max_workers``) or none is queued; the thread of each running call goes on here when
        it ends, so no queued call is left without a thread to start it."""
        begun = False
        while True:
            with self._lock:
                if not begun:  # one lock round for the turn and its first call: a hop's fixed cost
                    self._tokens -= 1
                    begun = True
                call = self._take()
                if call is None:
                    return
                # the take filled the last regular worker while a flow with none running waits (a
                # less urgent one, passed over by priority): a turn for the spare thread, which
                # ``run`` submitted none for
                more = (self._started >= self.max_workers and self.spare > 0
                        and self._started + self._tokens < self.max_workers + self.spare
                        and any(not self._flows[k].started for k in self._ready))
                self._tokens += more
            if more:
                try:
                    self._executor.submit(self._work)
                except RuntimeError:  # shut down meanwhile: the running threads still go on to it
                    with self._lock:
                        self._tokens -= 1
            try:
                if not call.future.set_running_or_notify_cancel():
                    continue
                try:
                    result = self._call(call.fn, call.args, call.kwargs)
                except BaseException as exc:
                    outcome: tuple[bool, Any] = (False, exc)
                else:
                    outcome = (True, result)
            finally:
                with self._lock:  # counted out before the caller hears (it may call again at once)
                    self._finished(call)
            if outcome[0]:
                call.future.set_result(outcome[1])
            else:
                call.future.set_exception(outcome[1])

    def _take(self) -> _Call | None:
        """Under ``_lock``: the next call a free thread may start (counted started), or None: of the
        flows with calls queued (on a spare thread: those with none running), one of the most urgent
        priority, then with the fewest calls running (a newcomer before a flow holding workers), then
        of the lowest round-robin rank (media/flows.py)."""
        if not self._ready or self._started >= self.max_workers + self.spare:
            return None
        flows = self._flows
        spare = self._started >= self.max_workers  # a spare thread: flows with none running only
        if len(self._ready) == 1:  # the usual case: one flow waiting
            best = next(iter(self._ready))
        else:
            waiting = [k for k in self._ready if not flows[k].started] if spare else self._ready
            if not waiting:
                return None
            best = min(waiting, key=lambda k: (flows[k].priority, flows[k].started, self._turns.rank(k)))
        state = flows[best]
        if spare and state.started:
            return None
        calls = self._ready[best]
        call = calls.popleft()
        if not calls:
            del self._ready[best]
        self._started += 1
        state.started += 1
        self._turns.serve(best)
        return call

    def _finished(self, call: _Call) -> None:
        """Under ``_lock``: ``call`` (started by ``_take``) returned or was skipped."""
        self._started -= 1
        self._flows[call.flow].started -= 1
        self._forget_if_idle(call.flow)

    def _unqueue(self, key: Hashable | None, future: Future) -> None:
        """Under ``_lock``: the call of flow ``key`` with ``future`` leaves the queue without
        starting (if it is still there)."""
        calls = self._ready.get(key)
        call = None if calls is None else next((c for c in calls if c.future is future), None)
        if call is None:
            return
        calls.remove(call)
        if not calls:
            del self._ready[key]
            self._forget_if_idle(key)

    def _forget_if_idle(self, key: Hashable | None) -> None:
        """Under ``_lock``: a flow with nothing queued or started is forgotten (it comes back as a
        newcomer: memory stays bounded by the calls admitted, a cancelled call leaving the queue at
        once)."""
        state = self._flows.get(key)
        if state is not None and not state.started and key not in self._ready:
            del self._flows[key]
            self._turns.forget(key)

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """On a worker thread: ``fn`` with the thread marked as this pool's worker (``blocked()``
        finds the pool there)."""
        _worker.pool = self
        try:
            return fn(*args, **kwargs)
        finally:
            _worker.pool = None


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
