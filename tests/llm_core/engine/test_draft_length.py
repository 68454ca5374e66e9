"""The adaptive draft length (llm_core/engine/speculative/adaptive.py): per-request k from its rate and
the batch size, the engine-wide acceptance prior new requests start from, the step gate from the
measured cost of a drafting step, scouts, and k never above the configured ``speculative_tokens``.
Deterministic: step costs are recorded by hand, never timed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.speculative.acceptance_prior import AcceptancePrior
from llm_core.engine.speculative.adaptive import DraftLength
from llm_core.engine.speculative.step_cost import StepCost
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


class Req:
    """A request stand-in (DraftLength only keys weak references by it)."""


def measured_cost(ratio: float, *batches: int, draft: int = 3) -> StepCost:
    """Steps drafting up to ``draft`` tokens measured at ``ratio`` plain steps (other levels estimated)."""
    cost = StepCost()
    for b in batches:
        cost.record(b, 0, 0.001 * b)
        cost.record(b, draft, 0.001 * b * ratio)
    return cost


def test_draft_length_adapts_down_to_zero_and_probes_together():
    dl = DraftLength(3, probe_every=4)
    good, bad = Req(), Req()
    assert dl.choose(good, 1) == dl.choose(bad, 1) == 3  # a fresh engine's prior is optimistic
    for _ in range(6):
        dl.update(good, 3, 3)
        dl.update(bad, 3, 0)
    dl.steps = 1
    assert dl.choose(good, 1) == 3 and dl.choose(bad, 1) == 0
    assert dl.threshold(1) < dl.threshold(8) < dl.threshold(32) == dl.threshold(64)
    dl.update(good, 3, 2)  # rate ~0.9: fine alone, too low for a full batch
    assert dl.choose(good, 1) == 3 and dl.choose(good, 32) < 3
    dl.steps = 4
    assert dl.choose(bad, 1) == 1  # every request at k = 0 probes in the same step
    assert dl.choose(bad, 32) == 0  # ... unless the batch is too large for one probe to matter
    assert DraftLength(3, adaptive=False).choose(bad, 64) == 3
    # idle = skips the MTP extend: poor everywhere, or at k = 0 where no probe can run
    assert dl.idle(bad, 1) and dl.idle(bad, 32) and not dl.idle(good, 1)
    dl.update(good, 3, 2)  # rate ~0.83: k = 0 in a full batch, where no probe runs either
    assert dl.choose(good, 32) == 0 and dl.idle(good, 32) and dl.choose(good, 1) == 3 and not dl.idle(good, 1)
    assert not DraftLength(3).idle(good, 32)  # never seen: it drafts


def test_prior_moves_down_after_rejections_and_up_after_acceptances():
    prior = AcceptancePrior()
    assert prior.rate == 1.0 and prior.samples == 0  # a fresh engine starts optimistic (documented)
    seen = [prior.rate]
    for _ in range(4):
        prior.update(3, 0)
        seen.append(prior.rate)
    assert all(a > b for a, b in zip(seen, seen[1:])) and seen[-1] < 0.1
    low = prior.rate
    prior.update(3, 3)
    assert prior.rate > low
    one, three = AcceptancePrior(initial=0.5), AcceptancePrior(initial=0.5)
    one.update(1, 1)
    three.update(3, 3)
    assert 0.5 < one.rate < three.rate <= 1.0  # a 3-token verify says more than a 1-token probe
    prior.update(0, 0)
    assert prior.samples == 5  # nothing drafted: nothing learned
    with pytest.raises(ValueError, match="prior"):
        AcceptancePrior(initial=1.5)


def test_new_requests_start_from_the_prior():
    dl = DraftLength(3)
    assert [dl.choose(Req(), b) for b in (1, 8, 32)] == [3, 3, 3]  # fresh engine: max_k everywhere
    for _ in range(3):
        dl.update(Req(), 3, 0)  # other requests' drafts fail
    assert dl.prior.rate < dl.min_gain
    fresh = Req()
    assert dl.choose(fresh, 8) == 0 and dl.rate(fresh) is None
    assert dl.idle(fresh, 8)  # at k = 0 where no probe runs: no MTP extend either
    for _ in range(6):
        dl.update(Req(), 3, 3)  # ... then they succeed
    assert dl.choose(Req(), 8) == 3 and dl.choose(Req(), 1) == 3
    dl.update(fresh, 3, 3)  # a request's own first verify replaces the prior it started from
    assert dl.rate(fresh) == 1.0


def test_step_gate_closes_for_a_few_middling_requests_and_opens_for_good_ones():
    dl = DraftLength(3, cost=measured_cost(2.0, 8))
    assert dl.cost.ratio(8, 3) == pytest.approx(2.0) and dl.cost.ratio(1, 3) == dl.cost.default(1, 3)
    batch = [Req() for _ in range(8)]
    for i, r in enumerate(batch):
        dl.update(r, 3, 2 if i < 4 else 0)  # half of them 2 of 3, the rest nothing
    dl.plan(batch)
    # alone each 2-of-3 request would draft at batch 8, but 4 x (0.67 + 0.44) tokens < 1 plain step's 8
    assert not dl.gate_open
    assert [dl.choose(r, 8) for r in batch] == [0] * 8 and all(dl.idle(r, 8) for r in batch)
    for r in batch:
        dl.update(r, 3, 3)
        dl.update(r, 3, 3)
    dl.plan(batch)
    assert dl.gate_open and all(dl.choose(r, 8) >= 1 for r in batch) and not any(dl.idle(r, 8) for r in batch)
    cheap = DraftLength(3, cost=measured_cost(1.0, 8))  # drafting costs nothing extra: never gated
    for i, r in enumerate(batch):
        cheap.update(r, 3, 2 if i < 2 else 0)
    cheap.plan(batch)
    assert cheap.gate_open and cheap.step_cap == 2  # the 2-of-3 requests' k at batch 8


def test_scouts_keep_a_low_prior_learning_at_large_batches():
    dl = DraftLength(3, scout_every=4)
    for _ in range(3):
        dl.update(Req(), 3, 0)
    starts = [dl.choose(Req(), 32) for _ in range(8)]
    assert starts == [0, 0, 0, 3, 0, 0, 0, 3]  # every 4th request that would start at 0 scouts
    scout = Req()
    for _ in range(3):
        dl.choose(Req(), 32)
    assert dl.choose(scout, 32) == 3 and not dl.idle(scout, 32)
    low = dl.prior.rate
    dl.update(scout, 3, 3)  # the traffic changed: the scout's verify raises the prior
    assert dl.prior.rate > low and dl.choose(scout, 32) == 3


def test_step_cost_is_per_request_bucketed_and_per_draft_cap():
    cost = StepCost()
    assert cost.ratio(8, 0) == 1.0 and cost.ratio(8, 2) == cost.default(8, 2)
    assert cost.default(8, 3) == pytest.approx(2.0) and cost.default(8, 1) < cost.default(8, 3)
    cost.record(8, 0, 0.008)
    assert cost.ratio(8, 3) == cost.default(8, 3) and not cost.measured(8, 3)  # only plain steps seen
    cost.record(12, 3, 0.036)  # 12 requests: same bucket as 8, 3 ms each against 1 ms
    assert cost.measured(8, 3) and cost.ratio(8, 3) == pytest.approx(3.0) and cost.ratio(32, 3) == cost.default(32, 3)
    assert cost.ratio(8, 1) == pytest.approx(1.0 + 2.0 / 3)  # unmeasured: the measured level's overhead per K
    cost.record(8, 1, 0.012)
    assert cost.ratio(8, 1) == pytest.approx(1.5) and cost.ratio(8, 3) == pytest.approx(3.0)
    assert cost.ratio(8, 2) == pytest.approx(2.0)  # the nearest level, the smaller on a tie
    for _ in range(4):
        cost.record(8, 3, 0.004)  # cheaper than plain (noise): never below 1
    assert cost.ratio(8, 3) >= 1.0
    cost.record(8, 3, 0.0)  # a zero-time sample (clock resolution) is not a measurement
    with pytest.raises(ValueError, match="step cost"):
        StepCost(per_token=-1.0)


def test_gate_on_a_fresh_engine_drafts_to_measure():
    """Defaults only, the optimistic prior (rate 1): every batch size drafts all 3 tokens (4 tokens for
    an estimated 2 plain steps), so the first steps measure what drafting costs."""
    for batch in (1, 8, 32):
        dl = DraftLength(3)
        reqs = [Req() for _ in range(batch)]
        dl.plan(reqs)
        assert dl.step_cap == 3 and [dl.choose(r, batch) for r in reqs] == [3] * batch


def test_gate_picks_the_cap_with_the_most_tokens_per_measured_cost():
    """Batch 32, rate 0.95: K = 1 (64 verify rows, one C call per layer) measured at 1.8 plain steps,
    K = 3 (128 rows, part by part) at 4.5: the gate tries K = 2 (estimated from K = 1 at 2.6 for 2.85
    tokens), measures it dear and settles on K = 1, then shuts when K = 1 gets dearer than its 1.95
    tokens; batch 8 likewise from K = 1 alone."""
    cost = StepCost()
    for k, ratio in ((0, 1.0), (1, 1.8), (3, 4.5)):
        cost.record(32, k, 0.032 * ratio)
    dl = DraftLength(3, cost=cost)
    reqs = [Req() for _ in range(32)]
    for r in reqs:
        dl.update(r, 20, 19)  # rate 0.95: k_i = 2 at batch 32 (0.95^3 < threshold 0.9)
    assert dl._k(0.95, 32) == 2
    dl.plan(reqs)
    assert dl.step_cap == 2 and not cost.measured(32, 2)  # estimated from K = 1 at 2.6: worth a try
    cost.record(32, 2, 0.032 * 3.5)
    dl.plan(reqs)
    assert dl.step_cap == 1 and [dl.choose(r, 32) for r in reqs] == [1] * 32
    for _ in range(3):
        cost.record(32, 1, 0.032 * 2.5)
    dl.plan(reqs)
    assert dl.step_cap == 0 and all(dl.idle(r, 32) for r in reqs)

    cost = StepCost()
    cost.record(8, 0, 0.008)
    cost.record(8, 1, 0.008 * 1.3)
    dl = DraftLength(3, cost=cost)
    reqs = reqs[:8]
    for r in reqs:
        dl.update(r, 20, 19)
    dl.plan(reqs)
    assert dl.step_cap == 3 and not cost.measured(8, 3)  # estimated 1.9 for 3.7 tokens: worth a step
    cost.record(8, 3, 0.008 * 3.5)
    dl.plan(reqs)
    assert dl.step_cap == 2  # measured dear; K = 2, estimated from K = 1 (1.6), gives the most per cost


def test_gate_closes_on_low_acceptance_and_reopens_at_batch_1_through_probes():
    """Text-like traffic (rate ~0.3) at batch 1 with measured costs: the gate closes; the requests then
    probe one token every probe_every steps, and good probes reopen it."""
    cost = StepCost()
    for k, ratio in ((0, 1.0), (1, 1.4), (2, 1.6), (3, 1.8)):
        cost.record(1, k, 0.001 * ratio)
    dl = DraftLength(3, cost=cost, probe_every=4)
    r = Req()
    dl.update(r, 3, 1)  # rate 0.33: 1.33 tokens for 1.4 plain steps' cost
    dl.plan([r])
    dl.steps = 1  # not a probe step
    assert dl.step_cap == 0 and dl.choose(r, 1) == 0 and dl.idle(r, 1)
    dl.steps = 4
    assert dl.choose(r, 1) == 1  # a probe
    for _ in range(4):
        dl.update(r, 1, 1)
    dl.plan([r])
    assert dl.step_cap == 3 and dl.choose(r, 1) == 3


@settings(max_examples=60, deadline=None)
@given(max_k=st.integers(1, 4), ops=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 64), st.integers(0, 4)),
                                             max_size=60))
def test_k_never_exceeds_the_configured_draft_tokens(max_k, ops):
    dl = DraftLength(max_k, scout_every=3, probe_every=2, cost=measured_cost(1.5, 1, 8))
    reqs = [Req() for _ in range(5)]
    for who, batch, accepted in ops:
        k = dl.choose(reqs[who], batch)
        assert 0 <= k <= max_k
        dl.steps += 1
        if k:
            dl.update(reqs[who], k, min(accepted, k))
        dl.plan(reqs[: 1 + who])
        assert 0.0 <= dl.prior.rate <= 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("mtp") / "hf", mtp_layers=3))


def test_engine_learns_the_prior_from_earlier_requests(model):
    """Random MTP layers draft badly: a second wave of requests on the same engine starts from the prior
    the first wave taught it and drafts less, with the same outputs as plain decoding; no verify step
    ever drafts more than ``speculative_tokens``."""
    cfg = dict(page_size=4, max_num_batched_tokens=64, num_full_tokens=2048, num_swa_tokens=512)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    waves = [[[5 + i, 9, 17 + w, 3 + i] for i in range(4)] for w in range(2)]
    plain = LLM.from_engine(LLMEngine(model, EngineConfig(speculative_tokens=0, **cfg)))
    eng = LLMEngine(model, EngineConfig(speculative_tokens=2, **cfg))
    assert eng.speculative.draft_length.prior.rate == 1.0 and eng.speculative.draft_length.gate_open
    llm, drafted, plain_steps = LLM.from_engine(eng), [], []
    real_run = eng.speculative.runner.run

    def counted(entries, kv):
        plain_steps.append(len(entries))
        return real_run(entries, kv)

    eng.speculative.runner.run = counted  # nothing drafts and every request idles: the plain step
    for prompts in waves:
        before = eng.stats().spec_draft_tokens
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
        drafted.append(eng.stats().spec_draft_tokens - before)
    s = eng.stats()
    assert len(s.spec_accepted_length) == 3  # accepted 0..2: k never above speculative_tokens
    assert eng.speculative.draft_length.prior.rate < 0.5
    assert drafted[1] < drafted[0] and drafted[0] >= 4 * 2  # the first wave starts optimistic
    assert len(plain_steps) >= 10


@pytest.mark.parametrize("batch", [1, 4])
def test_a_step_where_no_request_drafts_makes_the_plain_steps_aten_calls(model, monkeypatch, batch):
    """k = 0 for every request (the adaptive length has them all idle): a decode step dispatches
    exactly the ATen calls of the same step without MTP -- no MTP extend, no draft, no extra sampling."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    cfg = dict(page_size=4, max_num_batched_tokens=64, num_full_tokens=2048, num_swa_tokens=512)
    plain = LLMEngine(model, EngineConfig(speculative_tokens=0, **cfg))
    spec = LLMEngine(model, EngineConfig(speculative_tokens=3, **cfg))
    monkeypatch.setattr(spec.speculative.draft_length, "choose", lambda request, batch: 0)
    monkeypatch.setattr(spec.speculative.draft_length, "idle", lambda request, batch=1: True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for eng in (plain, spec):
        for i in range(batch):
            eng.add_request(str(i), [5 + i, 9, 17, 3 + i, 8], params)
        eng.step()  # the prompts (their MTP extend runs: the KV a later draft reads)
    decode_steps = 0
    while plain.has_unfinished():
        counts = []
        for eng in (plain, spec):
            with Count() as c:
                outs = eng.step()
            counts.append((c.ops, [(o.request_id, o.token_ids) for o in outs]))
        assert counts[0] == counts[1]
        decode_steps += 1
    assert decode_steps == 5 and not spec.has_unfinished() and spec.stats().spec_draft_tokens == 0
