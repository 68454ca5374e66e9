"""The ``priority`` queue policy (vLLM's ``--scheduling-policy priority``), driven without a model:
admission and budget by (priority, arrival), the least urgent request preempted first, a waiting
request that outranks a running one taking its seat or pages, page ownership under random
workloads, and the same schedule as ``fcfs`` when every priority is equal."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.engine.queue_policy import QueuePolicy
from llm_core.engine.request import Request, RequestStatus
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.scheduler import Scheduler
from llm_core.engine.scheduled_batch import ScheduledBatch
from tests.llm_core.engine.test_scheduler import check_invariants, make

_seq = iter(range(10**9))


def req(n_prompt: int, max_tokens: int = 4, priority: int = 0) -> Request:
    i = next(_seq)
    return Request(f"p{i}", list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), i, priority=priority)


def prioritized(**kw) -> Scheduler:
    s = make(**kw)
    s.queue_policy = QueuePolicy("priority")
    return s


def step(s: Scheduler, batch: ScheduledBatch | None = None) -> ScheduledBatch:
    """One scheduler step (``batch``: already scheduled) with the model's part faked: every request
    reaching its end samples a token."""
    if batch is None:
        batch = s.schedule()
        check_invariants(s, batch)
    s.after_step(batch)
    for e in batch.entries:
        if e.samples and not e.request.finished:
            e.request.append_token(7, None, None)
            if e.request.check_stop(max_model_len=10_000):
                s.finish(e.request, e.request.check_stop(max_model_len=10_000))
    return batch


def run_until_idle(s: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches = []
    while s.waiting or s.running:
        batches.append(step(s))
        assert len(batches) < max_steps, "scheduler did not finish"
    return batches


def first_step_of(batches: list[ScheduledBatch]) -> dict[str, int]:
    seen: dict[str, int] = {}
    for k, b in enumerate(batches):
        for e in b.entries:
            seen.setdefault(e.request.request_id, k)
    return seen


def test_policy_orders_by_priority_then_arrival_and_preempts_only_lower():
    policy = QueuePolicy("priority")
    a, b, c, d = req(4, priority=3), req(4, priority=-1), req(4, priority=3), req(4, priority=0)
    assert policy.order([a, b, c, d], lambda r: 0, 0.0) == [b, d, a, c]
    assert policy.preempts(d, a) and not policy.preempts(a, c) and not policy.preempts(a, b)
    fcfs = QueuePolicy("fcfs")
    assert fcfs.order([a, b, c, d], lambda r: 0, 0.0) == [a, b, c, d] and not fcfs.preempts(b, a)
    assert fcfs.rank(b) == (0, b.arrival_seq) and policy.rank(b) == (-1, b.arrival_seq)


def test_waiting_requests_are_admitted_most_urgent_first():
    s = prioritized(seqs=1)
    reqs = [req(4, max_tokens=2, priority=p) for p in (5, 0, 3, 0)]
    for r in reqs:
        s.add(r)
    starts = first_step_of(run_until_idle(s))
    order = sorted(reqs, key=lambda r: starts[r.request_id])
    assert [r.priority for r in order] == [0, 0, 3, 5]
    assert order[0] is reqs[1] and order[1] is reqs[3]  # equal priority: arrival order
    assert s.pool.all_free()


def test_budget_goes_to_the_most_urgent_request_first_waiting_or_running():
    s = prioritized(budget=4, seqs=4)
    low, high = req(12, max_tokens=1, priority=9), req(12, max_tokens=1, priority=1)
    s.add(low)
    first = step(s)  # low alone: its first chunk
    assert [e.request for e in first.entries] == [low]
    s.add(high)
    for _ in range(3):  # high's 12-token prompt in three chunks, ahead of low's prefill (budget 4)
        assert [e.request for e in step(s).entries] == [high]
    assert s.running == [low] and high.finished
    run_until_idle(s)
    assert low.num_output_tokens == 1 and low.num_preemptions == 0 and s.pool.all_free()

    fcfs = make(budget=4, seqs=4)  # the running low keeps the budget until its prompt is done
    low, high = req(12, max_tokens=1, priority=9), req(12, max_tokens=1, priority=1)
    fcfs.add(low)
    step(fcfs)
    fcfs.add(high)
    assert [[e.request for e in step(fcfs).entries] for _ in range(2)] == [[low], [low]]


def test_a_more_urgent_request_takes_the_seat_of_the_least_urgent():
    s = prioritized(seqs=2, budget=16)
    a, b = req(4, max_tokens=20, priority=5), req(4, max_tokens=20, priority=7)
    s.add(a)
    s.add(b)
    step(s)
    urgent = req(4, max_tokens=2, priority=0)
    s.add(urgent)
    batch = step(s)
    assert batch.preempted == [b]  # the least urgent, not the youngest (urgent) nor a
    assert {e.request.request_id for e in batch.entries} == {a.request_id, urgent.request_id}
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and not b.full_pages
    run_until_idle(s)
    assert urgent.num_output_tokens == 2 and a.num_output_tokens == b.num_output_tokens == 20
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and s.pool.all_free()


def test_equal_priority_never_preempts_for_admission():
    s = prioritized(seqs=1, budget=16)
    a = req(4, max_tokens=6, priority=2)
    s.add(a)
    step(s)
    s.add(req(4, max_tokens=2, priority=2))
    batches = run_until_idle(s)
    assert not any(b.preempted for b in batches) and a.num_preemptions == 0


def test_a_more_urgent_request_takes_the_pages_of_a_less_urgent_one():
    # 6 Full pages of 4 tokens: low holds 4 after its 16-token prompt, high needs 3 for its 12
    s = prioritized(full=24, swa=64, page=4, budget=32, seqs=8)
    low = req(16, max_tokens=3, priority=4)
    s.add(low)
    step(s)
    assert len(low.full_pages) == 4 and s.pool.full.num_free == 2
    high = req(12, max_tokens=2, priority=-3)
    s.add(high)
    batch = step(s)
    assert batch.preempted == [low] and [(e.request, e.num_new_tokens) for e in batch.entries] == [(high, 12)]
    run_until_idle(s)
    assert high.num_output_tokens == 2 and low.num_output_tokens == 3 and s.pool.all_free()


def test_a_victim_admitted_in_the_same_step_gives_back_its_entry_and_budget():
    # mid (p=5) decodes after its 16-token prompt and needs a 5th page; a (p=1) and z (p=9) wait.
    # a outranks mid, so mid is scheduled after the admissions: a and z take the 2 free pages,
    # then mid, short of one, preempts the least urgent running request: z, admitted this step.
    s = prioritized(full=24, swa=64, page=4, budget=32, seqs=8)
    mid = req(16, max_tokens=3, priority=5)
    s.add(mid)
    step(s)
    a, z = req(4, max_tokens=2, priority=1), req(4, max_tokens=2, priority=9)
    s.add(a)
    s.add(z)
    batch = s.schedule()
    check_invariants(s, batch)
    assert batch.preempted == [z] and z.status is RequestStatus.WAITING and not z.full_pages
    assert [(e.request, e.num_new_tokens) for e in batch.entries] == [(a, 4), (mid, 1)]
    step(s, batch)
    run_until_idle(s)
    assert [r.num_output_tokens for r in (mid, a, z)] == [3, 2, 2] and s.pool.all_free()


def test_fcfs_never_preempts_for_a_waiting_request_whatever_its_priority_field():
    s = make(full=24, swa=64, page=4, budget=32, seqs=8)
    low = req(16, max_tokens=3, priority=4)
    s.add(low)
    step(s)
    s.add(req(12, max_tokens=2, priority=-3))
    batches = run_until_idle(s)
    assert not any(b.preempted for b in batches) and low.num_preemptions == 0


workloads = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(-2, 2), st.integers(0, 6)),
                     min_size=1, max_size=8)


def drive_arrivals(s: Scheduler, work: list[tuple[int, int, int, int]], all_equal: bool = False) -> list[list]:
    """Requests (prompt, max_tokens, priority, arrival step) join at their step; every step's
    batch as (request id, start, new tokens) plus its preempted ids. Checks, every step: page
    ownership (check_invariants) and that no request scheduled is less urgent than one preempted
    in the same step."""
    # made in the order they join, as the engine numbers arrivals (arrival_seq) when they are added
    reqs = [(at, req(n, max_tokens=m, priority=0 if all_equal else p)) for n, m, p, at in sorted(work, key=lambda w: w[3])]
    index = {r.request_id: i for i, (_, r) in enumerate(reqs)}  # the trace names requests by position
    trace, k = [], 0
    while k < 10_000:
        for at, r in reqs:
            if at == k:
                s.add(r)
        if not (s.waiting or s.running) and k > max(at for at, _ in reqs):
            break
        batch = step(s)
        for victim in batch.preempted:
            assert all(s.queue_policy.rank(e.request) < s.queue_policy.rank(victim) for e in batch.entries)
        trace.append(([(index[e.request.request_id], e.start, e.num_new_tokens) for e in batch.entries],
                      [index[v.request_id] for v in batch.preempted]))
        k += 1
    for _, r in reqs:
        assert r.status is RequestStatus.FINISHED
        if r.finish_reason != "error":
            assert r.num_output_tokens == r.params.max_tokens
    assert s.pool.all_free()
    s.pool.check_integrity()
    return trace


@settings(max_examples=200, deadline=None)
@given(workloads, st.integers(6, 24), st.integers(4, 16), st.sampled_from([2, 4]), st.integers(2, 20),
       st.integers(1, 6))
def test_random_prioritized_workloads_keep_ownership_and_finish(work, full_pages, swa_pages, page, budget, seqs):
    s = prioritized(full=full_pages * page, swa=swa_pages * page, page=page, budget=budget, seqs=seqs)
    drive_arrivals(s, work)


@settings(max_examples=40, deadline=None)
@given(workloads, st.integers(6, 24), st.integers(4, 16), st.sampled_from([2, 4]), st.integers(2, 20),
       st.integers(1, 6))
def test_equal_priorities_schedule_exactly_as_fcfs(work, full_pages, swa_pages, page, budget, seqs):
    kw = dict(full=full_pages * page, swa=swa_pages * page, page=page, budget=budget, seqs=seqs)
    assert drive_arrivals(prioritized(**kw), work, all_equal=True) == drive_arrivals(make(**kw), work, all_equal=True)
