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

**The step gate.** Drafting costs mostly per step (step_cost.py: draft, extend, verify rows), and
how much depends on K, the step's largest draft length: a step of B requests drafting up to K tokens
costs R(B, K) plain steps, measured on the engine thread per (batch-size bucket, K). After each step
``plan`` takes the requests of that step, each with the k its rate allows (k_i), and picks the cap K
that gives the most tokens per cost:

    tokens(K) = B + sum over requests of (r + r^2 + ... + r^min(K, k_i))      (K = 0: B, cost 1)
    K* = argmax tokens(K) / R(B, K), the smallest K on a tie

and the next step's requests draft at most K* tokens (``step_cap``; the gate is open when K* > 0).
Requests that never verified count with the prior and are capped like the others (once the
traffic taught the prior that drafts fail, new requests do not open drafting steps). A level that
was never measured is estimated (StepCost's default, or the bucket's measured level rescaled), so it
is tried only where the estimate says it pays, and then measured. Scouts and probes
are not capped (rare, and the only way a low estimate can recover). Otherwise the held-back requests
are idle, and a step where every entry is an idle decode runs as a plain step (runner.py). This stops
a minority of requests with middling rates from turning every step into a drafting step for a few
expected tokens (text at batch 8: 4 of 8 requests drafting 1-2 tokens doubled a step's cost and
gained nothing), and a batch whose drafts pay at K = 1 (64 rows, one C call per layer) from paying
for K = 3 (128 rows, part by part).
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
        self.step_cap = max_k  # the step gate (``plan``): the most tokens a request drafts next step
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
        k = min(self._k(track.rate, batch), self.step_cap)
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
        if track.rate < self.min_gain or not self.gate_open:
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

    @property
    def gate_open(self) -> bool:
        return self.step_cap > 0

    def plan(self, requests: list) -> None:
        """Set the step gate for the next step from the requests of this one: the draft cap K that
        gives the most expected tokens per measured (or estimated) step cost (module docstring)."""
        if not self.adaptive or not requests:
            return
        batch = len(requests)
        # per request: the expected extra tokens of its first j drafts, j = 1 .. k_i; requests share
        # few distinct rates (the prior, 0 / 1 after a probe), so each is worked out once (a b32
        # step's bookkeeping is ~0.1 ms of Python, ~3 % of its plain step)
        by_rate: dict[float, list[float]] = {}
        gains = []
        for request in requests:
            track = self._tracks.get(request)
            rate = self.prior.rate if track is None else track.rate
            g = by_rate.get(rate)
            if g is None:
                g = by_rate[rate] = [rate ** i for i in range(1, self._k(rate, batch) + 1)]
            gains.append(g)
        self.step_cap = self.best_cap(batch, gains)

    def best_cap(self, batch: int, gains: list[list[float]]) -> int:
        """argmax over K of (batch + sum of the first K entries of each request's gains) / R(batch, K)."""
        counts: dict[int, list] = {}  # the same list object for requests of the same rate: summed once
        for g in gains:
            counts.setdefault(id(g), [g, 0])[1] += 1
        best, best_value = 0, 1.0  # K = 0: batch tokens at the cost of one plain step, per request
        for cap in range(1, self.max_k + 1):
            tokens = batch + sum(n * sum(g[:cap]) for g, n in counts.values())
            value = tokens / (batch * self.cost.ratio(batch, cap))
            if value > best_value + 1e-9:
                best, best_value = cap, value
        return best

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
