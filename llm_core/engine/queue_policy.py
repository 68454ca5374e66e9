"""Order in which the scheduler tries to admit waiting requests.

``fcfs``: arrival order (a preempted request goes back to the front).
``fewest_uncached``: the request with the fewest tokens left to compute after its prefix-cache hit
goes first, minus a wait-time credit so a long request is not starved by a stream of short ones:

    score = uncached_tokens - wait_credit_tokens_per_s * seconds_waiting        (lowest first)

    e.g. credit 1000 tok/s: a 9000-token request that has waited 8 s (score 1000) goes before a
    fresh 1500-token one (score 1500); ties keep arrival order.

Only the first ``lookahead`` waiting requests (in arrival order) are scored, which bounds the cost of
the prefix-cache probes per step.

``priority`` (vLLM's ``--scheduling-policy priority``): each request's ``priority`` decides, lower
first, arrival order among equals. It orders the waiting queue and the running set alike, so a
step's token budget and pages go to the most urgent requests first, the preemption victim is the
least urgent youngest request, and a waiting request that finds no seat or no pages may preempt
running requests of strictly lower priority (``preempts``; the scheduler does it, eviction of
cached pages first). Requests of one priority are served as under ``fcfs``.

    running  A(p=0)  B(p=5)  C(p=5, younger)       waiting  D(p=1)      pools full
    fcfs:      D waits until a request finishes
    priority:  C is preempted (its KV dropped, recomputed later), D is admitted; B then C resume
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from llm_core.engine.request import Request

POLICIES = ("fcfs", "fewest_uncached", "priority")
PRIORITY_LIMIT = 2**63  # a priority is an int64, as in vLLM (-2**63 <= priority < 2**63)


@dataclass(frozen=True)
class QueuePolicy:
    kind: str = "fcfs"
    wait_credit_tokens_per_s: float = 1000.0
    lookahead: int = 64

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"queue policy must be one of {POLICIES}, got {self.kind!r}")
        if self.wait_credit_tokens_per_s < 0:
            raise ValueError(f"wait_credit_tokens_per_s must be >= 0, got {self.wait_credit_tokens_per_s}")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {self.lookahead}")

    @property
    def uses_priority(self) -> bool:
        """Whether requests' ``priority`` counts (else every request must have priority 0)."""
        return self.kind == "priority"

    def check_priority(self, priority: object) -> str | None:
        """Why a request cannot have this ``priority`` (None if it can): any int64 under ``priority``,
        only 0 under the other policies (as vLLM refuses a priority its scheduler would ignore,
        rather than serve it in another order than asked)."""
        if type(priority) is not int or not -PRIORITY_LIMIT <= priority < PRIORITY_LIMIT:
            return f"priority must be an integer in [-2**63, 2**63), got {priority!r:.40}"
        if priority != 0 and not self.uses_priority:
            return (f"priority {priority} given but priority scheduling is off: start the engine with "
                    f"queue_policy 'priority' (--queue-policy priority)")
        return None

    def rank(self, request: Request) -> tuple[int, int]:
        """Sort key of the running set: most urgent first, so the last one is the preemption victim
        (arrival order alone unless ``priority``)."""
        return (request.priority if self.kind == "priority" else 0, request.arrival_seq)

    def preempts(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` may take the seat and pages of ``running`` when it finds none free."""
        return self.kind == "priority" and running.priority > waiting.priority

    def order(self, waiting: Sequence[Request], cached_tokens: Callable[[Request], int],
              now: float) -> list[Request]:
        """``waiting`` (in arrival order) rearranged into admission order."""
        if self.kind == "fcfs" or len(waiting) < 2:
            return list(waiting)
        if self.kind == "priority":  # the whole queue: a late urgent request must not sit past a lookahead
            return sorted(waiting, key=self.rank)
        items = list(waiting)
        head, rest = items[:self.lookahead], items[self.lookahead:]

        def score(item: tuple[int, Request]) -> tuple[float, int]:
            i, r = item
            uncached = r.num_tokens - max(r.num_computed_tokens, cached_tokens(r))
            return uncached - self.wait_credit_tokens_per_s * max(0.0, now - r.arrival_time), i

        return [r for _, r in sorted(enumerate(head), key=score)] + rest
