"""The engine thread: LLM steps (and, with the encoder worker off, encoder batches), off the event loop.

By default the encoder runs beside this thread on its own worker (runtime/encoder_worker.py) and
``batcher`` is None here; with ``encoder_worker=False`` this thread runs both, one after the other:

    loop:  clear wake ─► batcher.run_due()            (encoder forwards that are due; inline only)
                     ─► llm.step() if llm.has_ready_work()   ─► outputs to each request's sink
                     ─► publish the stats snapshot (the LLM's, then ``on_stats``: the omni one)
                     ─► nothing done? wait for a wake (new request, abort, encoder job, unit
                        arrival) or the batcher's next due time

A request whose embeddings are not ready cannot progress; the engine then has no ready work and the
thread sleeps instead of spinning ``step()`` (on a 2-core host a spinning engine would steal the
decode workers' CPU). The loop asks the engine (``has_ready_work``, ``last_step_progressed``); it
does not read the scheduler's queues. Sinks run on
this thread and must only hand the output over (``loop.call_soon_threadsafe``).

Without an LLM (``llm`` None: an encoders-only runtime) the thread runs encoder batches only and
takes no requests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from llm_core.distributed.rank_failure import RankFailure
from llm_core.engine.llm_engine import LLMEngine
from llm_core.engine.outputs import ErrorKind, RequestOutput
from llm_core.engine.request import EmbeddingSource
from mm_pipeline.errors import ServerBusy
from llm_core.engine.sampling import SamplingParams
from mm_pipeline.encode.batcher import EncoderBatcher
from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads
from mm_pipeline.runtime.cpu_threads.thread_choice import StepThreads

log = logging.getLogger(__name__)
OutputSink = Callable[[RequestOutput], None]


class EngineLoop:
    """Owns the thread that drives ``llm`` and ``batcher``; thread-safe request entry points."""

    def __init__(self, llm: LLMEngine | None, batcher: EncoderBatcher | None, idle_wait_s: float = 0.05,
                 threads: int | Callable[[], int] | None = None, step_threads: StepThreads | None = None,
                 warm_up_rows: int = 0) -> None:
        self.llm = llm
        self.batcher = batcher  # None: the encoder worker runs the batches
        self.idle_wait_s = idle_wait_s
        # this thread's intra-op threads (CPU), set once at its start: a count, or a callable asked
        # then (runtime/cpu_threads/thread_choice.py: measured on this thread); None: torch's setting
        self.threads = threads
        self.threads_used: int | None = None  # the count set at start
        # with a policy, that count is the team a long step on free cores gets; other steps run at 1
        self.step_threads = step_threads
        # a scratch prefill of this many rows first thing on the thread (CPU): the allocator's heap
        # grows to the largest step once, at start, not inside the first long request (page faults:
        # 15-30 ms of a 376-row step's first run on the 2-core host)
        self.warm_up_rows = warm_up_rows
        self.ready = threading.Event()  # set once the thread's start-up (warm-up, thread count) is done
        # spans of LLM steps (monotonic start, end) for a stage timeline; None: off
        self.on_step_span: Callable[[float, float], None] | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._sinks: dict[str, OutputSink] = {}
        self._stop = False
        self._closing = False  # end_all was called: the server is going away, new requests are refused
        self.counts = {"steps": 0, "idle_waits": 0, "encoder_units": 0, "loop_errors": 0, "sink_errors": 0}
        # Builds and publishes the owner's stats snapshot; called on this thread after every
        # iteration (set before start()).
        self.on_stats: Callable[[], None] | None = None
        # Called once (on this thread) when the engine cannot go on -- a tensor/expert-parallel rank
        # died (RankFailure): every open request has ended with an error by then; `mmserve serve`
        # stops the server with it.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal: BaseException | None = None
        self._was_busy = True
        self._thread = threading.Thread(target=self._run, name="omni-engine", daemon=True)

    # ---- public API (any thread) ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    embeds: EmbeddingSource | None, sink: OutputSink, **extra) -> None:
        """Queue a request; every output for it goes to ``sink`` (on the engine thread)."""
        if self.fatal is not None:
            raise RuntimeError(f"the engine stopped: {self.fatal}")
        if self.llm is None:
            raise RuntimeError("an encoders-only runtime has no LLM and takes no requests")
        with self._lock:
            if self._closing:  # one still preparing its media when end_all ran must not start now
                raise ServerBusy("the server is shutting down; retry on another replica or later")
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = sink
        try:
            self.llm.add_request(request_id, prompt_token_ids, params, embeds=embeds, **extra)
        except BaseException:
            with self._lock:
                self._sinks.pop(request_id, None)
            raise
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request; its sink gets a final output (finish_reason "abort") unless it already
        finished."""
        with self._lock:
            if request_id not in self._sinks:
                return
        self.llm.abort(request_id)
        self._wake.set()

    def end_all(self) -> int:
        """Abort every open request and refuse new ones (``ServerBusy``): a server shutting down
        ends what is still running at the end of its grace period. Each sink gets its final output
        (finish_reason "abort"), which its handler answers as any abort: a 503, or a stream's error
        event. The thread keeps running (``stop`` ends it). Returns how many were aborted."""
        with self._lock:
            self._closing = True
            request_ids = list(self._sinks)
        for request_id in request_ids:
            self.llm.abort(request_id)
        self._wake.set()
        return len(request_ids)

    def detach(self, request_id: str) -> None:
        """Stop delivering outputs of ``request_id`` (its consumer is gone)."""
        with self._lock:
            self._sinks.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._sinks)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; every request still waiting for outputs gets a final "abort"."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            self._hand_over(sink, RequestOutput(request_id=rid, prompt_token_ids=[], finished=True,
                                                finish_reason="abort", error="the engine was shut down"))

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.llm is None or self.llm.device.type == "cpu":
                self._start_threads()
        finally:
            self.ready.set()
        while not self._stop:
            self._wake.clear()  # before checking: a wake that comes after this is not lost
            try:
                if self.llm is not None:
                    self.llm.check_health()
                did = self._step_once()
                self._publish_stats(did)
            except RankFailure as exc:
                self._die(exc)
                return
            except Exception:  # a bug must not kill serving; it is logged and counted
                log.exception("engine loop iteration failed")
                self.counts["loop_errors"] += 1
                did = False
                time.sleep(0.01)
            if not did:
                self.counts["idle_waits"] += 1
                self._wake.wait(self._idle_timeout())

    def _start_threads(self) -> None:
        """Warm the heap up, then set (or measure) this thread's count; with a step policy the
        runner asks it per step from now on and the thread idles at one."""
        if self.warm_up_rows and self.llm is not None:
            try:
                with torch.inference_mode():
                    self.llm.probe_prefill(self.warm_up_rows)
            except Exception:  # a warm-up must never stop the engine
                log.exception("the engine's warm-up step failed")
        if self.threads is None:
            return
        self.threads_used = self.threads() if callable(self.threads) else self.threads
        set_local_threads(self.threads_used)
        if self.step_threads is not None and self.llm is not None and self.threads_used > 1:
            self.step_threads.start(self.threads_used)  # measures its min_rows when asked to
            self.llm.runner.before_step = self.step_threads.apply
            set_local_threads(1)

    def _die(self, exc: RankFailure) -> None:
        """End every open request with the failure and stop; the owner decides what else stops."""
        log.critical("the engine stopped: %s", exc)
        self.fatal, self._stop = exc, True
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            self._hand_over(sink, RequestOutput(request_id=rid, prompt_token_ids=[], finished=True,
                                                finish_reason="error", error=f"the engine stopped: {exc}",
                                                error_kind=ErrorKind.INTERNAL))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _step_once(self) -> bool:
        did = False
        n = self.batcher.run_due() if self.batcher is not None else 0
        if n:
            self.counts["encoder_units"] += n
            did = True
        if self.llm is not None and self.llm.has_ready_work():
            t0 = time.monotonic()
            outputs = self.llm.step()
            if self.on_step_span is not None and self.llm.last_step_progressed:  # not a step that found nothing
                self.on_step_span(t0, time.monotonic())
            self.counts["steps"] += 1
            self._dispatch(outputs)
            # a step that scheduled nothing (pools full while the running requests wait for their
            # media) must not make the thread spin
            did = did or self.llm.last_step_progressed
        return did

    def _publish_stats(self, busy: bool) -> None:
        """A step published the LLM's snapshot already; an idle iteration refreshes it (completely
        on the first one after work: "idle after the last step"), then the owner's is built."""
        if not busy and self.llm is not None:
            self.llm.publish_stats(complete=self._was_busy)
        self._was_busy = busy
        if self.on_stats is not None:
            self.on_stats()

    def _idle_timeout(self) -> float:
        due = self.batcher.next_due() if self.batcher is not None else None
        if due is None:
            return self.idle_wait_s
        return max(0.0, min(self.idle_wait_s, due - time.monotonic()))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None and not self._hand_over(sink, out) and not out.finished:
                self.detach(out.request_id)  # nobody can take its outputs: stop generating them
                self.llm.abort(out.request_id)

    def _hand_over(self, sink: OutputSink, out: RequestOutput) -> bool:
        """Give ``out`` to its sink. One that raises (its consumer's event loop is already closed)
        costs that request alone: the outputs after it in the step still reach their requests."""
        try:
            sink(out)
            return True
        except Exception:
            log.exception("the output sink of request %s failed", out.request_id)
            self.counts["sink_errors"] += 1
            return False
