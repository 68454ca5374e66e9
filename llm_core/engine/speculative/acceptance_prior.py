"""AcceptancePrior: the engine-wide acceptance estimate a new request's draft length starts from.

A request's own acceptance is unknown until its first verify step. Starting every request
optimistic (k = max) costs a multi-row verify step per request on traffic the MTP head drafts poorly
(text on a captioning head: a 4-row step that mostly rejects, ~3 plain steps' worth in a 32-token
answer at batch 8). The prior is what the engine has recently seen instead: an exponential moving
average of accepted / drafted over the *first* verify step of recent requests (what it predicts;
DraftLength.update), each weighted by its number of draft tokens (a 3-token verify says more than a
1-token one):

    w = 1 - decay ** drafted          rate <- rate + w * (accepted / drafted - rate)

(decay 0.8: a 3-token verify moves it half way, so a batch's first step sets it for the requests that
start after it, and at batch 1 two or three requests do).

A fresh engine starts at ``initial`` (1.0: a checkpoint's MTP layers are trained on its own kind of
output, so the first requests measure rather than assume the worst); a few verify steps of the
actual traffic then set it.
"""

from __future__ import annotations


class AcceptancePrior:
    def __init__(self, *, initial: float = 1.0, decay: float = 0.8) -> None:
        if not 0.0 <= initial <= 1.0:
            raise ValueError(f"acceptance prior must be in [0, 1], got {initial}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"acceptance prior decay must be in (0, 1), got {decay}")
        self.rate, self.decay = initial, decay
        self.samples = 0  # verify steps seen

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        w = 1.0 - self.decay ** drafted
        self.rate += w * (accepted / drafted - self.rate)
        self.samples += 1
