"""How many draft tokens a request gets this step: from its recent acceptance, the batch size and
what a drafting step costs.

Each request keeps an exponential moving average ``r`` of its per-token acceptance (accepted / drafted).
The i-th draft token is accepted with probability about ``r^i`` and costs one more target token in the
verify step, so it is proposed only while ``r^i`` clears a threshold that grows with the number of
running requests: at batch 1 a decode step is memory- or overhead-bound and extra tokens are nearly
free; at large batches the step is compute-bound and a rejected token costs real throughput.

    threshold(B) = min_gain + (B - 1) / (full_batch - 1) * (max_gain - min_gain), clamped
    k = #{ i in 1..max_k : r^i >= threshold(B) }          (0 = plain decoding for that request)

A request at k = 0 tries one draft token every ``probe_every`` engine steps, so its estimate can
recover, but only at batch sizes where one accepted probe can bring it back (``1 - decay`` clears the
threshold): a probe step costs several plain steps. All such requests probe in the *same* step: a
batch that mixes 1-token and multi-token requests takes the attention's general (slower) path, so
probes spread over steps would slow every step. A request that will not draft soon ("idle") also
skips the MTP extend (proposer.py), so a batch of them runs nearly at plain-decoding cost: one
measured so poorly that it drafts only in probe steps, or one at k = 0 at a batch size where no probe
runs -- its rate cannot change until the batch shrinks, and an extend every step would cost one MTP
layer pass per token for nothing (text on the demo model at batch 32: 0.87x plain with it). When it
drafts again its MTP KV has the idle positions missing: drafts are worse for a window, outputs exact.

**Where a request starts.** Before its first verify a request's rate is the engine-wide
``AcceptancePrior`` (acceptance_prior.py: 1.0 on a fresh engine, then an average over the first
verify steps of recent requests), so on traffic the MTP head drafts poorly new requests start at a low k, or at 0, instead of
paying an optimistic 1 + max_k-row verify each. Its first own verify replaces the prior. A prior that
fell low would keep every new request at k = 0 at large batches (no probes run there) even after the
traffic changed, so every ``scout_every``-th request that would start at 0 starts at ``max_k`` (a
scout): its verify feeds the prior.

**The step gate.** Drafting costs mostly per step (step_cost.py: draft, extend, the target's mixed
attention path): a drafting step of B requests costs R(B) plain steps, R measured on the engine
thread. After each step ``plan`` sums the expected extra tokens of the requests that would draft,
G = sum over requests of r + r^2 + ... + r^k, and the next step drafts only if G >= (R - 1) * B,
the extra tokens that pay for the extra cost. Otherwise no measured request drafts (probes and
scouts aside; a request that never verified starts from the prior, else a gate closed on priors
would never see evidence) and the held-back requests are idle. A step where every entry is an idle
decode runs as a plain step (runner.py). This stops a minority of requests with
middling rates from turning every step into a drafting step for a few expected tokens (text at batch
8: 4 of 8 requests drafting 1-2 tokens doubled a step's cost and gained nothing).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from llm_core.engine.speculative.acceptance_prior import AcceptancePrior
from llm_core.engine.speculative.step_cost import StepCost


@dataclass
class _Track:
    rate: float
    measured: bool = False  # False: ``rate`` is the prior the request started from
    scout: bool = False  # drafts max_k until measured, whatever the prior and the gate say


class DraftLength:
    """Per-request draft length; ``adaptive=False`` always proposes ``max_k`` (capped by the caller)."""

    def __init__(self, max_k: int, *, adaptive: bool = True, min_gain: float = 0.2, max_gain: float = 0.9,
                 full_batch: int = 32, decay: float = 0.7, probe_every: int = 16, scout_every: int = 64,
                 prior: AcceptancePrior | None = None, cost: StepCost | None = None) -> None:
        self.max_k, self.adaptive = max_k, adaptive
        self.min_gain, self.max_gain, self.full_batch = min_gain, max_gain, full_batch
        self.decay, self.probe_every, self.scout_every = decay, probe_every, scout_every
        self.prior = prior if prior is not None else AcceptancePrior()
        self.cost = cost if cost is not None else StepCost()
        self._tracks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.steps = 0  # engine steps so far (SpeculativeRunner counts them): the probe clock
        self.gate_open = True  # the step gate (``plan``); open on a fresh engine
        self._zero_starts = 0  # requests that started at k = 0 (every scout_every-th one scouts)

    def threshold(self, batch: int) -> float:
        frac = min(1.0, max(0.0, (batch - 1) / max(1, self.full_batch - 1)))
        return self.min_gain + frac * (self.max_gain - self.min_gain)

    def choose(self, request, batch: int) -> int:
        """k for ``request`` this step, with ``batch`` requests running (never above ``max_k``)."""
        if not self.adaptive:
            return self.max_k
        track = self._track(request, batch)
        if track.scout and not track.measured:
            return self.max_k
        # the gate holds back measured requests only: one that has never verified starts from the prior
        # and measures itself, else a gate closed on priors would never see evidence to reopen
        k = self._k(track.rate, batch) if self.gate_open or not track.measured else 0
        # probe only where one accepted probe could bring the request back (rate 0 -> 1 - decay):
        # at large batches a probe step (every request 2 tokens) costs several plain steps
        if k == 0 and track.measured and self.steps % self.probe_every == 0 and self._probes(batch):
            return 1
        return k

    def idle(self, request, batch: int = 1) -> bool:
        """The request will not draft soon: measured so poorly, or held back by the closed gate, that
        it drafts only in probe steps, or at k = 0 at ``batch`` requests where no probe runs."""
        track = self._tracks.get(request)
        if not self.adaptive or track is None or (track.scout and not track.measured):
            return False
        if track.rate < self.min_gain or (track.measured and not self.gate_open):
            return True  # drafts only in probe steps: its MTP KV is not worth keeping until then
        return track.rate < self.threshold(batch) and not self._probes(batch)

    def update(self, request, drafted: int, accepted: int) -> None:
        """A verify step of ``request``: ``accepted`` of its ``drafted`` tokens were right."""
        if drafted <= 0:
            return
        track = self._tracks.get(request)
        sample = accepted / drafted
        if track is None or not track.measured:
            # the prior predicts a new request's first verify, so it learns from first verifies only:
            # later ones include each request's last, where the target ends the answer and the drafts
            # mostly did not see it coming (captions: ~0.9 first, ~0.5 over all verifies)
            self.prior.update(drafted, accepted)
            self._tracks[request] = _Track(sample, measured=True)  # its own evidence replaces the prior
        else:
            track.rate = self.decay * track.rate + (1.0 - self.decay) * sample

    def plan(self, requests: list) -> None:
        """Open or close the step gate for the next step from the requests of this one: drafting pays
        when their expected extra tokens reach (R - 1) plain steps' worth of tokens."""
        if not self.adaptive or not requests:
            return
        batch = len(requests)
        gain = 0.0
        for request in requests:
            track = self._tracks.get(request)
            rate = self.prior.rate if track is None else track.rate
            gain += sum(rate ** i for i in range(1, self._k(rate, batch) + 1))
        self.gate_open = gain >= (self.cost.ratio(batch) - 1.0) * batch

    def rate(self, request) -> float | None:
        """The request's own measured rate (None before its first verify)."""
        track = self._tracks.get(request)
        return track.rate if track is not None and track.measured else None

    # ---- internal helpers -----------------------------------------------------------------------
    def _k(self, rate: float, batch: int) -> int:
        t = self.threshold(batch)
        k = 0
        while k < self.max_k and rate ** (k + 1) >= t:
            k += 1
        return k

    def _probes(self, batch: int) -> bool:
        """Probes run at this batch size: one accepted probe (rate 0 -> 1 - decay) clears the threshold."""
        return 1.0 - self.decay >= self.threshold(batch)

    def _track(self, request, batch: int) -> _Track:
        track = self._tracks.get(request)
        if track is None:
            track = self._tracks[request] = _Track(self.prior.rate)
            if self._k(track.rate, batch) == 0:
                self._zero_starts += 1
                track.scout = self._zero_starts % self.scout_every == 0
        return track
