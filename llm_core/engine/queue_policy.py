"""Order in which the scheduler tries to admit waiting requests.

``fcfs``: arrival order (a preempted request goes back to the front).
``fewest_uncached``: the request with the fewest tokens left to compute after its prefix-cache hit
goes first, minus a wait-time credit so a long request is not starved by a stream of short ones:

    score = uncached_tokens - wait_credit_tokens_per_s * seconds_waiting        (lowest first)

    e.g. credit 1000 tok/s: a 9000-token request that has waited 8 s (score 1000) goes before a
    fresh 1500-token one (score 1500); ties keep arrival order.

Only the first ``lookahead`` waiting requests (in arrival order) are scored, which bounds the cost of
the prefix-cache probes per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from llm_core.engine.request import Request

POLICIES = ("fcfs", "fewest_uncached")


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

    def order(self, waiting: Sequence[Request], cached_tokens: Callable[[Request], int],
              now: float) -> list[Request]:
        """``waiting`` (in arrival order) rearranged into admission order."""
        if self.kind == "fcfs" or len(waiting) < 2:
            return list(waiting)
        items = list(waiting)
        head, rest = items[:self.lookahead], items[self.lookahead:]

        def score(item: tuple[int, Request]) -> tuple[float, int]:
            i, r = item
            uncached = r.num_tokens - max(r.num_computed_tokens, cached_tokens(r))
            return uncached - self.wait_credit_tokens_per_s * max(0.0, now - r.arrival_time), i

        return [r for _, r in sorted(enumerate(head), key=score)] + rest
