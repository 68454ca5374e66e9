"""Which pending jobs an encoder batch takes (``BatcherConfig.order``; the batcher: batcher.py).

``fair`` (the default): requests take turns. A job carries the flow
(request) that claimed its unit and that request's priority (the engine's ``priority`` queue policy;
0 otherwise); a batch takes jobs by priority, then by the round-robin rank of their flow
(media/flows.py: the flow served longest ago first, a newcomer just before the flow served last),
then -- among flows of one rank, such as newcomers that came while one forward ran -- the flow
with the fewest queued rows first, then in arrival order. On a CPU encoder a forward's time grows
with its rows, so an image packed with a video's frame groups waits for their rows too (an image
sent while a 60 s video encodes: README, "Overlap, measured"). There a batch ends before the first
job whose flow is of the other kind than the first job's -- a newcomer (not served yet) where that
one is served, or the reverse -- or whose flow has more than twice the rows queued of the flows
before it together: so no flow passes one whose turn came first, an image is not packed with a video
already encoding nor with the groups of a new one, and a burst of like images still batches. On
CUDA a packed forward of a few more rows costs about what the image's alone does, so batches mix.
``arrival``: (priority, arrival) order, one queue for every request.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from typing import TYPE_CHECKING, Sequence

from mm_pipeline.media.flows import Turns

if TYPE_CHECKING:
    from mm_pipeline.encode.batcher import EncoderJob

# CPU: a flow joins a batch while its queued rows are at most this many times those of the flows
# already in it (module doc): each join at most triples the forward the earlier flows wait for
JOIN_RATIO = 2


def arrival_batch(q: deque[EncoderJob], share: int, budget: int) -> list[EncoderJob]:
    """The ``arrival`` order's batch of queue ``q`` (in arrival order) -- most urgent first; the
    sort is stable, so arrival order within one priority."""
    order = sorted(q, key=lambda j: j.priority) if any(j.priority for j in q) else q
    return fill(order, share, budget)


def fair_batch(q: deque[EncoderJob], turns: Turns, share: int, budget: int, cpu: bool) -> list[EncoderJob]:
    """The ``fair`` order's batch of queue ``q`` (module doc): by priority, then the flow's
    round-robin rank in ``turns``, then (flows of one rank) its queued rows, fewest first, then
    arrival (a stable sort of the arrival-ordered queue). On a ``cpu`` encoder only the jobs before
    the first whose flow is of the other kind (newcomer / served) than the first job's, or holds
    more than ``JOIN_RATIO`` times the queued rows of the flows before it together."""
    if len(q) == 1:
        return [q[0]]
    rows: Counter[Hashable] = Counter()
    for job in q:
        rows[job.turn_key] += job.cost
    order = sorted(q, key=lambda j: (j.priority, turns.rank(j.turn_key), rows[j.turn_key]))
    if cpu:
        order = order[:_cpu_cut(order, turns, rows)]
    return fill(order, share, budget)


def fill(order: Sequence[EncoderJob], share: int, budget: int) -> list[EncoderJob]:
    """The first jobs of ``order`` while the batch holds fewer than ``share`` and fits ``budget``
    (always at least one, even if it alone exceeds the budget)."""
    batch: list[EncoderJob] = []
    used = 0
    for job in order:
        if batch and (len(batch) >= share or used + job.cost > budget):
            break
        batch.append(job)
        used += job.cost
    return batch


def _cpu_cut(order: Sequence[EncoderJob], turns: Turns, rows: Counter[Hashable]) -> int:
    """Where a CPU batch of ``order`` ends: at the first job whose flow is a newcomer where the
    first job's is served or the reverse (none passes a flow whose turn came first), or whose flow's
    queued ``rows`` exceed ``JOIN_RATIO`` times those of the flows before it together (a new
    video's frame groups do not make the image that came with it wait for their rows; a burst of
    images of mixed sizes still batches)."""
    served = turns.served(order[0].turn_key)
    taken: set[Hashable] = set()
    before = 0
    for i, job in enumerate(order):
        key = job.turn_key
        if key in taken:
            continue
        if turns.served(key) != served or (taken and rows[key] > JOIN_RATIO * before):
            return i
        taken.add(key)
        before += rows[key]
    return len(order)
