"""Speculative verify steps on the fingerprinting harness of test_swa_radix_cache.py: drafts (right or
wrong at random) are written into the pools like any token, the scheduler rolls rejected positions
back, and every later read of a Full key or a window of SWA keys -- by the same request, by a request
that hits the prefix cache, after a preemption -- must see the fingerprint of the *accepted* prefix.
``check_integrity`` with exact page references after every step; every page free at the end."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.llm_core.kvcache.test_swa_radix_cache import BASES, Harness


class SpecHarness(Harness):
    """Harness whose decoding requests verify ``k`` drafts per step; a draft is right with ``p``."""

    def __init__(self, *, k: int, p: float, seed: int, **kw) -> None:
        super().__init__(**kw)
        self.sched.draft_tokens = lambda req, running: k
        self.rng, self.p = random.Random(seed), p
        self.verified = self.rejected = 0

    def next_token(self, r) -> int:
        return 3 + int(self.fingerprints(r)[-1]) % 5  # the fake target's greedy token

    def step(self):
        batch = self.sched.schedule()
        ends, stopped = {}, []
        for e in batch.entries:
            r, base = e.request, len(e.request.token_ids)
            for _ in range(e.num_draft_tokens):
                true = self.next_token(r)
                r.token_ids.append(true if self.rng.random() < self.p else 3 + (true - 2) % 5)
            self._check_and_write(r, e.start, e.end)
            drafts = r.token_ids[base:]
            del r.token_ids[base:]
            if not (e.samples or e.num_draft_tokens):
                continue
            emitted = []
            for d in drafts + [None]:  # target tokens until the first mismatch, plus the bonus
                y = self.next_token(r)
                r.append_token(y, None, None)
                emitted.append(y)
                reason = r.check_stop(max_model_len=10_000)
                if reason or d != y:
                    break
            if e.num_draft_tokens:
                ends[id(e)] = e.start + len(emitted)
                self.verified += 1
                self.rejected += e.num_draft_tokens + 1 - len(emitted)
            if reason:
                stopped.append((r, reason))
        self.sched.after_step(batch, ends)
        for r, reason in stopped:
            self.sched.finish(r, reason)
        return batch


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), window=st.sampled_from([1, 2, 3, 5, 8]), page=st.sampled_from([1, 2, 3, 4]),
       k=st.integers(1, 5), p=st.sampled_from([0.0, 0.5, 0.9, 1.0]), tight=st.booleans(),
       chunk=st.sampled_from([None, 3, 7]))
def test_rollback_keeps_every_read_key_right(seed, window, page, k, p, tight, chunk):
    rng = random.Random(seed)
    full_pages = 14 if tight else 120
    h = SpecHarness(k=k, p=p, seed=seed, window=window, page=page, full_pages=full_pages,
                    swa_pages=full_pages, checkpoint=0, budget=16, chunk=chunk, interval=2, seqs=3)
    for i in range(rng.randint(2, 6)):  # shared bases: later requests hit what earlier ones cached
        base = BASES[rng.randrange(len(BASES))]
        h.add(base[: rng.randint(1, 20)] + [rng.randrange(10, 60) for _ in range(rng.randint(0, 4))],
              max_tokens=rng.randint(1, 14) if i else 12)
    h.drain()
    assert all(r.finished for r in h.requests)
    if not tight:  # tight pools refuse drafts (they never evict or preempt) and fail some requests
        assert h.verified > 0
        if p == 0.0:
            assert h.rejected > 0
    h.cache.clear()
    assert h.pool.all_free()
