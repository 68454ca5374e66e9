"""Intra-op thread counts chosen by measurement (CPU): the engine thread's and the encoder's.

Why measure instead of taking every core: a second intra-op thread pays only when the OpenMP team's
threads meet at each op's barrier without waiting, and inside this process they often do not.
libgomp gives every thread that runs a parallel region its own team (the engine thread, the encoder
thread, the loading thread...), and once the process holds more OpenMP threads than CPUs it stops
spinning between regions and parks them on a futex: every op then pays a wake-up. On the 2-core
host that made the repeat request's 376-row prefill step slower at 2 threads than at 1 (31 -> 37
ms) while the same ops ran 1.6-1.9x faster at 2 in a process with a single team, and the vision
tower's frame group likewise (22 -> 29 ms). With a single team (spinning) a busy neighbour is worse
still: a barrier spins while its partner waits for the core (steps of 50-1000 ms at 2 threads, load
3-4). Whether N threads pay is thus a property of the host and of the process, so it is measured
once, at start, on the thread that will run the work (README "Overlap, measured"):

    engine thread:   probe_prefill (a scratch prompt through every layer)  at 1, N, 1, N ...
    encoder thread:  a frame group through the vision tower                at 1, N, 1, N ...
                     -> the count with the lower best time, fewer threads unless N wins by PREFER_FEWER

Each thread first starts its N-thread team and waits for the other probe to have started its own,
so both measure with every team the process keeps (a team stays once started: the process is then
in the parking mode it will run in); then the probes take turns (a shared lock), each timing the
second of two runs per count (the first after a switch of ``torch.set_num_threads`` pays ~1.8 ms
that a thread keeping its count never pays).

The engine thread owns the process's one wide team (wave 2 session 11). libgomp parks idle team
threads only while the process holds more OpenMP threads than CPUs; so on a CPU LLM the encoder
lanes run at one thread each (no team), the model loads on a short-lived thread (its team dies with
it: ``run_on_thread``), the media and text workers run at one thread, and the engine thread's team
(its measured count) is the only one: its threads spin between ops and a long step on free cores
scales (the repeat request's 376-row step: 29 -> 20 ms on 2 cores, against 26 -> 29 ms with the
teams parked). A spinning team is fast only while its threads have cores, so the count is chosen
per step (``StepThreads``): the team for a step of at least ``min_rows`` rows (measured at start,
``measure_min_rows``, or configured) while the process's other CPU work (busy decode workers,
encoder lanes) and other processes (host_cpu.py) leave the cores free; one thread otherwise (a
short step, a prefill beside a video decode).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from mm_pipeline.runtime.encoder_worker import default_threads, free_cpu_threads, split_threads
from mm_pipeline.runtime.cpu_threads.host_cpu import HostCpu
from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads

log = logging.getLogger(__name__)

PREFER_FEWER = 0.05  # more threads must be this much faster (best time) to be chosen: they cost CPU others could use
ROUNDS = 4  # timed runs per count at most (each after an untimed one at the same count) ...
BUDGET_S = 0.5  # ... or fewer once a probe has taken this long (at least one round)
BARRIER_TIMEOUT_S = 30.0  # how long a probe waits for the others to start their teams
PROBE_ROWS = 256  # the LLM probe's prompt: one streamed prefill step (stream_min_tokens' default)
# A step of fewer rows runs at one thread: a decode batch of a few requests is too small for a
# barrier per op to pay. From 16 rows the C kernels split by their work (kernels/native/team.h
# split_work_on_team), so a short prefill -- the ~30 rows of a question after a prefix-cache hit --
# can use both cores: that step ran 4.86 -> 3.88 ms on a 2-core host (benchmarks/repeat_step.py, in
# place) and decode at batch 32 2,812 -> 3,746 tokens/s. (128 before the kernels split short calls:
# their torch ops alone did not pay for a team.)
WIDE_MIN_ROWS = 16
# Whether it does is the host's, so with --llm-team-min-rows auto the engine thread measures it at its
# start, once its team won the long probe (StepThreads.start -> measure_min_rows): a scratch prefill
# of each size here at one thread and on the team, as measure_threads times counts, the larger size
# first. The team from WIDE_MIN_ROWS rows when it wins at the smallest size; from the smallest size
# it wins at when that is a larger one; else only from PROBE_ROWS rows, where it won. On the 2-core
# AVX2 EPYC (wave 2 session 44) it lost at both (32 rows 4.0 vs 4.3 ms, 128 rows 11.2 vs 12.0, one
# thread vs two): steps of fewer rows keep one thread, which took the same-prefix request's 24-row
# step 4.66 -> 4.08 ms and its TTFT 6.89 -> 6.37 ms (medians of 48 each, alternating in one process),
# and decode batches of 16 / 32 requests 2,486 -> 2,674 / 3,615 -> 3,731 tokens/s. In place, steps
# back to back, the 29-row step still ran faster on the team (3.91 vs 3.03 ms), its second thread
# already running and its caches warm; a request's step starts it after the idle time between
# requests, and the probe's position-0 prefills found one thread faster as the request path did.
SHORT_PROBE_ROWS = (32, 128)
SHORT_PROBE_ROUNDS = 3  # timed runs per count and size at most ...
SHORT_PROBE_BUDGET_S = 0.1  # ... or fewer once a size has taken this long: ~0.1-0.15 s of every start of a CPU LLM
# The engine thread's warm-up step (EngineLoop.warm_up_rows): max_num_batched_tokens rows, at most
# this many -- a streamed prefill step's and a cached-media repeat's size; a 2048-row scratch step
# took ~0.5 s of every start of a tiny test model, for steps that long prompts alone reach.
WARM_UP_MAX_ROWS = 512


@dataclass(frozen=True)
class ThreadChoice:
    """A thread's intra-op count and how it was reached: ``how`` "measured" (``best_ms``: the fastest run per
    count tried), "fixed" (configured), "follow" (re-read per batch) or "torch" (torch's setting)."""

    threads: int | None
    how: str
    best_ms: Mapping[int, float] = field(default_factory=dict)
    seconds: float = 0.0  # how long the measuring took

    def describe(self) -> str:
        count = "torch's setting" if self.threads is None else str(self.threads)
        if not self.best_ms:
            return f"{count} ({self.how})"
        timed = ", ".join(f"{n}: {ms:.1f} ms" for n, ms in sorted(self.best_ms.items()))
        return f"{count} (measured in {self.seconds:.2f} s: {timed})"


def measure_threads(work: Callable[[], object], candidates: tuple[int, ...], *, rounds: int = ROUNDS,
                    budget_s: float = BUDGET_S, prefer_fewer: float = PREFER_FEWER,
                    clock: Callable[[], float] = time.perf_counter) -> ThreadChoice:
    """Time ``work`` on the calling thread at each count of ``candidates`` (ascending, distinct),
    taking turns, and leave the thread at the chosen one. Every turn runs ``work`` twice and times
    the second run: the first pays the switch (the team wakes, caches fill). A count with more
    threads is chosen only when its fastest run is more than ``prefer_fewer`` below that of the best
    count with fewer. Rounds stop early once ``budget_s`` is spent (after the first)."""
    if not candidates or list(candidates) != sorted(set(candidates)) or candidates[0] < 1:
        raise ValueError(f"candidates must be distinct, ascending and >= 1, got {candidates}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if len(candidates) == 1:
        set_local_threads(candidates[0])
        return ThreadChoice(candidates[0], "fixed")
    times: dict[int, list[float]] = {n: [] for n in candidates}
    start = clock()
    for _ in range(rounds):
        for n in candidates:
            set_local_threads(n)
            work()  # untimed: the first ops after a switch pay ~1.8 ms that a thread keeping its count never pays
            t0 = clock()
            work()
            times[n].append(clock() - t0)
        if clock() - start > budget_s:
            break
    # the fastest run: a busy moment of the host only ever adds time, and what is asked is what the
    # count does on free cores (StepThreads keeps a step at one thread when they are not free)
    best = {n: min(ts) * 1e3 for n, ts in times.items()}
    chosen = candidates[0]
    for n in candidates[1:]:
        if best[n] < best[chosen] * (1 - prefer_fewer):
            chosen = n
    set_local_threads(chosen)
    return ThreadChoice(chosen, "measured", best, clock() - start)


class ProbedThreads:
    """A thread's intra-op count measured the first time it is asked for (on the asking thread,
    i.e. the engine thread or the encoder worker at their start), the same count ever after.
    ``work`` is the probe; ``lock`` is shared by a runtime's probes so they never overlap. A probe
    that fails leaves the thread at ``fallback`` (logged); ``ready`` is set once chosen."""

    def __init__(self, name: str, work: Callable[[], object], candidates: tuple[int, ...], lock: threading.Lock,
                 fallback: int) -> None:
        self.name = name
        self.work = work
        self.candidates = candidates
        self.lock = lock
        self.fallback = fallback
        self.choice: ThreadChoice | None = None
        self.ready = threading.Event()
        self.barrier: threading.Barrier | None = None  # shared by a runtime's probes (_meet)
        self._claim = threading.Lock()
        self._measuring = False  # one caller measures (encoder lanes all ask); the others wait for it

    def __call__(self) -> int:
        if self.choice is None:
            with self._claim:
                first, self._measuring = not self._measuring, True
            if not first:
                self.ready.wait()
        if self.choice is None:
            self._meet()
            with self.lock:
                try:
                    with torch.inference_mode():
                        self.choice = measure_threads(self.work, self.candidates)
                except ProbeUnavailable as exc:
                    log.info("the %s keeps %d intra-op threads: %s", self.name, self.fallback, exc)
                    set_local_threads(self.fallback)
                    self.choice = ThreadChoice(self.fallback, "fixed")
                except Exception:  # a probe must never stop the thread it runs on
                    log.exception("measuring the %s's intra-op threads failed; using %d", self.name, self.fallback)
                    set_local_threads(self.fallback)
                    self.choice = ThreadChoice(self.fallback, "fixed")
                finally:
                    self.ready.set()
        assert self.choice.threads is not None
        return self.choice.threads

    def _meet(self) -> None:
        """Start this thread's OpenMP team (one untimed run at the most threads), then wait for the
        runtime's other probes to have started theirs: every probe then measures with all the teams
        the process will keep -- whether libgomp spins or parks idle team threads depends on how
        many OpenMP threads the whole process holds (module doc), and a team, once started, stays."""
        if self.barrier is None:
            return
        try:
            set_local_threads(self.candidates[-1])
            with torch.inference_mode():
                self.work()
        except Exception:  # measure_threads meets it again and reports it
            pass
        try:
            self.barrier.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            log.warning("the %s measures its threads without the other probes' teams", self.name)


class StepThreads:
    """The engine thread's intra-op count per step (CPU): ``wide`` (its team, measured or configured
    at its start) for a step of at least ``min_rows`` rows while the cores are free, else one.
    ``short_probe`` (rows -> a scratch prefill of that many rows): ``min_rows`` is measured at the
    engine thread's start instead (:meth:`start`, :func:`measure_min_rows` on ``clock``);
    ``short_choices`` keeps what each size measured.

    Free: ``cpus`` minus the CPUs this process's other work holds (``busy()``: busy decode workers
    and encoder lanes) minus other processes' recent use (``host``, rounded) leaves ``wide``; a step
    gets fewer threads than that never (a partner waiting for a taken core stalls every op's
    barrier). Counts ``wide_steps`` and ``narrowed_steps`` (long steps kept at one thread)."""

    def __init__(self, cpus: int, busy: Callable[[], int], host: HostCpu | None = None,
                 min_rows: int = WIDE_MIN_ROWS,
                 short_probe: Callable[[int], Callable[[], object]] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if cpus < 1 or min_rows < 1:
            raise ValueError(f"StepThreads needs cpus >= 1 and min_rows >= 1, got {cpus}, {min_rows}")
        self.cpus = cpus
        self.busy = busy
        self.host = host
        self.min_rows = min_rows
        self.short_probe, self.clock = short_probe, clock
        self.short_choices: dict[int, ThreadChoice] = {}
        self.wide = 1  # set by the engine thread at its start (EngineLoop -> start)
        self.counts = {"wide_steps": 0, "narrowed_steps": 0}

    def start(self, wide: int) -> None:
        """On the engine thread, at its start, once its team count ``wide`` is known: with a short
        probe and a team, measure ``min_rows`` (:func:`measure_min_rows`; a probe that cannot run or
        fails keeps the configured value). Leaves the thread's count to the caller."""
        self.wide = wide
        if self.short_probe is None or wide <= 1:
            return
        try:
            with torch.inference_mode():
                self.min_rows, self.short_choices = measure_min_rows(self.short_probe, wide, clock=self.clock)
        except ProbeUnavailable as exc:
            log.info("the engine thread keeps its team from %d rows: %s", self.min_rows, exc)
        except Exception:  # a probe must never stop the engine thread
            log.exception("measuring the engine thread's short steps failed; the team serves from %d rows",
                          self.min_rows)

    def describe(self) -> str:
        """How ``min_rows`` was reached, for the start-up line: "" (configured), or per size measured
        its fastest run per count."""
        if not self.short_choices:
            return ""
        return "measured: " + "; ".join(
            f"{rows} rows " + ", ".join(f"{n}: {ms:.1f} ms" for n, ms in sorted(c.best_ms.items()))
            for rows, c in sorted(self.short_choices.items()))

    def apply(self, rows: int) -> None:
        """Set the calling (engine) thread's count for a step of ``rows`` rows: ModelRunner's
        ``before_step`` hook. Only this thread's count changes (intra_op.set_local_threads)."""
        n = self(rows)
        if n != torch.get_num_threads():
            set_local_threads(n)

    def __call__(self, rows: int) -> int:
        if self.wide <= 1 or rows < self.min_rows:
            return 1
        taken = self.busy() + (round(self.host.others()) if self.host is not None else 0)
        if self.cpus - taken < self.wide:
            self.counts["narrowed_steps"] += 1
            return 1
        self.counts["wide_steps"] += 1
        return self.wide


def measure_min_rows(probe: Callable[[int], Callable[[], object]], wide: int,
                     sizes: tuple[int, ...] = SHORT_PROBE_ROWS, longest: int = PROBE_ROWS,
                     rounds: int = SHORT_PROBE_ROUNDS, budget_s: float = SHORT_PROBE_BUDGET_S,
                     clock: Callable[[], float] = time.perf_counter) -> tuple[int, dict[int, ThreadChoice]]:
    """(the fewest rows of a step the team of ``wide`` serves, what each size measured): each of
    ``sizes`` (ascending) timed as :func:`measure_threads` times counts, at one and ``wide``, the
    largest first; once one thread wins a size the smaller ones are not timed. The team serves from
    WIDE_MIN_ROWS rows when it won at every size, from the smallest size it won at otherwise, and
    from ``longest`` (the long probe's rows, where it won) when it won at none."""
    if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
        raise ValueError(f"sizes must be distinct, ascending and >= 1, got {sizes}")
    choices: dict[int, ThreadChoice] = {}
    least = longest
    for rows in reversed(sizes):
        choices[rows] = choice = measure_threads(probe(rows), (1, wide), rounds=rounds, budget_s=budget_s, clock=clock)
        if choice.threads == 1:
            break
        least = rows
    return (WIDE_MIN_ROWS if least == sizes[0] else least), choices


def run_on_thread(fn: Callable[[], object], name: str) -> object:
    """``fn()`` on a new thread, joined; its result or its exception. The OpenMP team its torch ops
    start ends with the thread (libgomp frees a thread's pool when it exits), so loading a model
    this way leaves no idle team behind to make the engine's team park (module doc)."""
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    t = threading.Thread(target=target, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (e.g. the KV pools cannot spare its pages): keep the fallback."""


def llm_probe(llm, rows: int = PROBE_ROWS) -> Callable[[], None]:
    """One prefill step of ``rows`` scratch tokens through ``llm`` (an LLMEngine; probe_prefill)."""
    def work() -> None:
        if not llm.probe_prefill(rows):
            raise ProbeUnavailable("the engine cannot run a scratch prefill here")
    return work


def vision_probe(vision) -> Callable[[], object]:
    """One video frame group through the vision tower ``vision``: one temporal patch of 5 x 9 merge
    units (180 patch rows at merge size 2: a 160 x 288 frame pair, the pipeline benchmark's)."""
    cfg = vision.config
    m = cfg.spatial_merge_size
    grid = (1, 5 * m, 9 * m)
    rows = torch.randn(grid[0] * grid[1] * grid[2], cfg.patch_dim, generator=torch.Generator().manual_seed(0))
    rows = rows.to(device=vision.device, dtype=vision.dtype)
    return lambda: vision.encode_items([(rows, grid)])


def plan_threads(llm_threads: int | str | None, encoder_threads: int | str | None, llm, vision,
                 encoder_device: torch.device, pool
                 ) -> tuple[int | ProbedThreads, int | Callable[[], int], list[ProbedThreads]]:
    """(engine thread, encoder worker, probes): each thread's intra-op count -- a count (none:
    torch's setting on the constructing thread), a probe measured on that thread at its start
    ("auto"), or the encoder's follower of ``pool``'s busy decode workers (0) -- from the configured
    values (OmniEngineConfig.llm_threads / encoder_threads). ``vision``: the tower the encoder
    worker runs (None: no worker or no tower); ``llm``: the LLMEngine (None: encoders only)."""
    total = default_threads()
    lock = threading.Lock()
    llm_share: int | ProbedThreads
    enc_share: int | Callable[[], int]
    enc = encoder_threads
    if enc == 0:  # follow the decoders: the CPUs their busy workers leave
        enc_share = free_cpu_threads(total, lambda: pool.busy)
    elif isinstance(enc, int):
        enc_share = split_threads(total, enc)[1]
    elif enc == "auto" and vision is not None and torch.device(encoder_device).type == "cpu":
        if llm is not None and llm.device.type == "cpu" and llm_threads == "auto":
            enc_share = 1  # the engine thread owns the one wide team (module doc): the lanes run at one each
        else:
            enc_share = 1 if total == 1 else ProbedThreads("encoder", vision_probe(vision), (1, total), lock,
                                                           fallback=total)
    else:  # none (or auto without a vision tower): torch's setting here, set on the thread itself, for
        # a thread that sets none takes whatever count another thread set last (ATen keeps one value)
        enc_share = total
    if isinstance(llm_threads, int):
        llm_share = llm_threads
    elif llm_threads == "auto" and llm is not None and llm.device.type == "cpu":
        if isinstance(enc, int) and enc > 0:  # --encoder-threads N: the engine thread keeps the rest
            llm_share = split_threads(total, enc)[0]
        else:
            llm_share = 1 if total == 1 else ProbedThreads("engine thread", llm_probe(llm), (1, total), lock,
                                                           fallback=total)
    else:  # none: torch's setting here (as for the encoder above)
        llm_share = total
    probes = [p for p in (llm_share, enc_share) if isinstance(p, ProbedThreads)]
    barrier = threading.Barrier(len(probes)) if probes else None
    for p in probes:
        p.barrier = barrier
    return llm_share, enc_share, probes
