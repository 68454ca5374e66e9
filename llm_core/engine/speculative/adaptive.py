"""How many draft tokens a request gets this step: from its recent acceptance and the batch size.

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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass


@dataclass
class _Track:
    rate: float


class DraftLength:
    """Per-request draft length; ``adaptive=False`` always proposes ``max_k`` (capped by the caller)."""

    def __init__(self, max_k: int, *, adaptive: bool = True, min_gain: float = 0.2, max_gain: float = 0.9,
                 full_batch: int = 32, decay: float = 0.7, probe_every: int = 16) -> None:
        self.max_k, self.adaptive = max_k, adaptive
        self.min_gain, self.max_gain, self.full_batch = min_gain, max_gain, full_batch
        self.decay, self.probe_every = decay, probe_every
        self._tracks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.steps = 0  # engine steps so far (SpeculativeRunner counts them): the probe clock

    def threshold(self, batch: int) -> float:
        frac = min(1.0, max(0.0, (batch - 1) / max(1, self.full_batch - 1)))
        return self.min_gain + frac * (self.max_gain - self.min_gain)

    def choose(self, request, batch: int) -> int:
        if not self.adaptive:
            return self.max_k
        track = self._tracks.get(request)
        rate = 1.0 if track is None else track.rate  # optimistic start: the first steps measure it
        t = self.threshold(batch)
        k = 0
        while k < self.max_k and rate ** (k + 1) >= t:
            k += 1
        # probe only where one accepted probe could bring the request back (rate 0 -> 1 - decay):
        # at large batches a probe step (every request 2 tokens) costs several plain steps
        if k == 0 and track is not None and self.steps % self.probe_every == 0 and 1.0 - self.decay >= t:
            return 1
        return k

    def idle(self, request, batch: int = 1) -> bool:
        """The request will not draft soon: measured so poorly that it drafts only in probe steps
        (k = 0 at batch 1), or at k = 0 at ``batch`` requests where no probe runs."""
        track = self._tracks.get(request)
        if not self.adaptive or track is None:
            return False
        t = self.threshold(batch)
        return track.rate < self.min_gain or (track.rate < t and 1.0 - self.decay < t)

    def update(self, request, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        track = self._tracks.get(request)
        sample = accepted / drafted
        if track is None:
            self._tracks[request] = _Track(sample)
        else:
            track.rate = self.decay * track.rate + (1.0 - self.decay) * sample

    def rate(self, request) -> float | None:
        track = self._tracks.get(request)
        return None if track is None else track.rate
