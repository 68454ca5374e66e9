"""The ingress's refresh of every LLM replica's stats snapshot: one Serve broadcast, each replica's
answer used as it arrives.

    RemoteEngine.refresh_stats ── handle.broadcast("replica_stats") ──► every LLM replica
        gather_answers: Serve's result of each replica, awaited on its own until the deadline
          an answer        that replica's snapshot is replaced at once (ReplicaSnapshots.answer)
          a failure        (dying, its engine stopped) the replica is left out
          none by then     "silent": its request is cancelled, its last snapshot is kept, marked
                           late with when it last answered, for up to STATS_STALE_S; then left out
          only the silent  a round after one with s silent replicas: once all but s have answered,
          left             it waits ``settle_s`` (the refresh period) from its start, not the
                           deadline, so the others' snapshots stay as fresh as without a silence
        ReplicaSnapshots.end_round: the view stats() serves (ReplicaStats), named in a log line

Serve's public collection, ``DeploymentBroadcastResponse.results_async(timeout_s=...)``, is all or
nothing: one replica alive but silent (a hung engine thread, a GC pause, a stuck actor) made it
raise at the deadline, and the answers the other replicas had given were thrown away -- every
snapshot aged, and after ``STATS_STALE_S`` the ingress's /health was 503 for a deployment whose
other replicas were fine. So the broadcast's per-replica results (Ray's ``ReplicaResult``: what
``results_async`` itself gathers; ``get_async``, ``cancel``) are awaited here one by one. Serve
reaches them only through ``DeploymentBroadcastResponse._fetch_replica_results_async`` (Ray 2.60);
a Ray without it gets the public all-or-nothing collection (a silent replica then fails the whole
refresh again), with a warning. tests/mm_pipeline/cluster/serving/test_replica_snapshots.py checks
that the installed Ray has it.

A replica's answer does not say which broadcast result it was before it arrives (a result carries
no replica id): a replica that never answered is only counted (``ReplicaStats.unanswered``); one
known from an earlier answer is named. A refresh with no silent replica drops every known replica
that did not answer (failed, or no longer among the replicas Serve asked), as before; one with no
answer at all changes no snapshot: the deployment's stats then age as a whole, and ``stats()``
raises once none has answered for ``STATS_STALE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mm_pipeline.cluster.serving.replica_metrics import ReplicaStats

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """One refresh's broadcast: replicas asked, answers used, results failed, replicas silent at the
    deadline (``asked`` is None where Serve's per-replica results were not to be had)."""

    asked: int | None = 0
    answered: int = 0
    errors: list[BaseException] = field(default_factory=list)
    silent: int = 0


async def gather_answers(response: Any, timeout_s: float, on_answer: Callable[[Any], None], *,
                         expect_silent: int = 0, settle_s: float = 0.0) -> Tally:
    """Await each replica's result of ``response`` (a ``DeploymentBroadcastResponse``) on its own until
    ``timeout_s``: ``on_answer(value)`` as each answer arrives; the results still out at the
    deadline are cancelled (on the replica too: a stuck one must not queue a request per refresh).

    ``expect_silent``: how many replicas were silent in the round before. Once no more than that many
    results are out, the round ends ``settle_s`` after it began instead: a hung replica held every
    round to the full deadline, and the healthy replicas' snapshots were then asked for once per
    ``timeout_s`` (5 s) instead of once per refresh period. It still gets ``settle_s`` to answer
    each round, and a round where it does ends as soon as every replica has answered. (A result
    names no replica before it answers, so the count is all there is to go by.)"""
    start = time.monotonic()
    deadline = start + timeout_s
    settle = start + min(settle_s, timeout_s)
    fetch = getattr(response, "_fetch_replica_results_async", None)
    if fetch is None:
        return await _all_or_nothing(response, timeout_s, on_answer)
    results = await asyncio.wait_for(fetch(), timeout_s)
    waits = {asyncio.ensure_future(r.get_async()): r for r in results}
    tally, pending = Tally(asked=len(results)), set(waits)

    def take(done: set[asyncio.Future]) -> None:
        for t in done:
            if t.cancelled():  # Serve's answer to a request cancelled on the replica
                tally.errors.append(RuntimeError("the replica cancelled its answer"))
            elif (exc := t.exception()) is not None:
                tally.errors.append(exc)
            else:
                _use(t.result(), on_answer, tally)

    try:
        while pending and (left := (settle if len(pending) <= expect_silent else deadline) - time.monotonic()) > 0:
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            take(done)
        # an answer that came between the last wait and the deadline's check is an answer, not a
        # silence (and a failure read here is not left for asyncio's "never retrieved" log line)
        done = {t for t in pending if t.done()}
        take(done)
        pending -= done
    finally:  # the deadline, or the refresh itself cancelled
        for t in pending:
            t.cancel()
            try:
                waits[t].cancel()
            except Exception as exc:  # noqa: BLE001 -- best effort: the replica may be gone by now
                log.debug("cancelling a replica's stats request failed: %s", exc)
    tally.silent = len(pending)
    return tally


_warned_all_or_nothing = False


async def _all_or_nothing(response: Any, timeout_s: float, on_answer: Callable[[Any], None]) -> Tally:
    global _warned_all_or_nothing
    if not _warned_all_or_nothing:
        _warned_all_or_nothing = True
        log.warning("this Ray's broadcast has no per-replica results (DeploymentBroadcastResponse."
                    "_fetch_replica_results_async): a replica that does not answer the stats refresh within "
                    "%.0f s fails it for all", timeout_s)
    try:
        answers = await response.results_async(timeout_s=timeout_s, return_exceptions=True)
    except TimeoutError:
        raise TimeoutError(f"not every LLM replica answered within {timeout_s:g} s (all or nothing: this "
                           f"Ray's broadcast has no per-replica results)") from None
    tally = Tally(asked=None)
    for a in answers:
        if isinstance(a, BaseException):
            tally.errors.append(a)
        else:
            _use(a, on_answer, tally)
    return tally


def _use(answer: Any, on_answer: Callable[[Any], None], tally: Tally) -> None:
    try:
        on_answer(answer)
    except Exception as exc:  # noqa: BLE001 -- a malformed answer is that replica's failure
        tally.errors.append(exc)
    else:
        tally.answered += 1


@dataclass
class _Answer:
    snapshot: Any
    at: float  # time.monotonic() on the ingress when it arrived


class ReplicaSnapshots:
    """Every LLM replica's last answer and the view ``RemoteEngine.stats()`` serves (``view``);
    ``last_answer_at``: when any replica last answered."""

    def __init__(self) -> None:
        self.view: ReplicaStats | None = None
        self.last_answer_at = 0.0
        self._answers: dict[str, _Answer] = {}
        self._late: frozenset[str] = frozenset()
        self._unanswered = 0
        self._logged: tuple[int, frozenset[str]] = (0, frozenset())  # the silence last logged at WARNING

    @property
    def unanswered(self) -> int:
        """Replicas silent at the last round's deadline (its ``Tally.silent``)."""
        return self._unanswered

    def answer(self, got: Any) -> None:
        """One replica's answer (``LLMReplica.replica_stats``: its id and its snapshot), at once."""
        name, snapshot = got
        now = time.monotonic()
        self._answers[name] = _Answer(snapshot, now)
        self._late -= {name}
        self.last_answer_at = now
        self._publish(now)

    def end_round(self, started: float, tally: Tally, stale_s: float) -> None:
        """A refresh that began at ``started`` ended: the replicas known from earlier answers that
        did not answer it are kept (late; for at most ``stale_s`` since each last answered) or
        dropped, and a silence is logged."""
        now = time.monotonic()
        missing = sorted(n for n, a in self._answers.items() if a.at < started)
        dropped = []
        if tally.answered:  # else the deployment ages as a whole (stats() raises after stale_s)
            for name in missing:
                if not tally.silent or now - self._answers[name].at > stale_s:
                    del self._answers[name]  # failed or gone (no replica was silent), or silent too long
                    dropped.append(name)
        if dropped and tally.silent:
            log.warning("LLM replica stats: %s not answered for over %.0f s: left out",
                        ", ".join(dropped), stale_s)
        self._late = frozenset(n for n in missing if n in self._answers)
        self._unanswered = tally.silent
        self._log_silence(tally, now)
        if self._answers:
            self._publish(now)

    def silence(self, now: float | None = None) -> str:
        """The replicas known from earlier answers that did not answer the last refresh, each with the
        seconds since it last did ('' if none)."""
        now = time.monotonic() if now is None else now
        return ", ".join(f"{n} (last answered {now - self._answers[n].at:.1f} s ago)" for n in sorted(self._late))

    def _log_silence(self, tally: Tally, now: float) -> None:
        if not tally.answered:
            return  # the refresh fails, naming them (RemoteEngine.refresh_stats), and that is logged
        seen = (tally.silent, self._late)
        if not tally.silent:
            if self._logged[0]:
                log.info("LLM replica stats: every replica answered again")
            self._logged = (0, frozenset())
            return
        asked = f" of {tally.asked}" if tally.asked is not None else ""
        named = self.silence(now) or "none answered before"
        # at WARNING when the silence changes: /health asks for a refresh every second or so
        level = logging.WARNING if seen != self._logged else logging.DEBUG
        self._logged = seen
        log.log(level, "LLM replica stats: %d%s replicas did not answer by the deadline (%s); the snapshots of "
                "the %d that answered are current", tally.silent, asked, named, tally.answered)

    def _publish(self, now: float) -> None:
        self.view = ReplicaStats({n: a.snapshot for n, a in self._answers.items()}, now,
                                 answered_at={n: a.at for n, a in self._answers.items()},
                                 late=self._late, unanswered=self._unanswered)
