"""StepCost: what a decode step with drafts costs next to a plain one at the same batch size, measured.

Drafting pays when the tokens it adds outweigh what it costs, and on a CPU the cost is mostly per
*step*, not per draft row: once any request of a batch drafts, the step runs the MTP draft, the MTP
extend, the target's general attention path for mixed query lengths, and MoE paths sized for more
rows (demo model, text, batch 8: a plain step 4.4 ms CPU, the same step with 4 of 8 requests
drafting 1-2 tokens 9.0 ms). So the policy (adaptive.py) needs the ratio

    R(B) = (CPU time per request of a decode step with drafts) / (... of a plain decode step)

at batch size B, which SpeculativeRunner measures on the engine thread (``time.thread_time``, which
other processes do not inflate) for every step whose entries are all decodes (a prefill chunk would
dominate the time). Batch sizes are bucketed by powers of two; each bucket keeps an exponential
moving average per kind. Until a bucket has seen both kinds, R is ``default_ratio`` (2.0: batch 8,
text, every request drafting 3 tokens measured 10.7 vs 5.4 ms on the demo model; batch 1, 5.5 vs
3.6 ms).
"""

from __future__ import annotations


class StepCost:
    def __init__(self, *, default_ratio: float = 2.0, decay: float = 0.8) -> None:
        if default_ratio < 1.0:
            raise ValueError(f"default step cost ratio must be >= 1, got {default_ratio}")
        self.default_ratio, self.decay = default_ratio, decay
        self._per_request: dict[tuple[int, bool], float] = {}  # (bucket, drafted) -> seconds per request

    @staticmethod
    def bucket(batch: int) -> int:
        return max(1, batch).bit_length()  # 1 | 2-3 | 4-7 | 8-15 | 16-31 | 32-63 | ...

    def record(self, batch: int, drafted: bool, seconds: float) -> None:
        """One decode-only step of ``batch`` requests took ``seconds`` (some drafted, or none did)."""
        if batch <= 0 or seconds <= 0.0:
            return
        key = (self.bucket(batch), drafted)
        sample = seconds / batch
        old = self._per_request.get(key)
        self._per_request[key] = sample if old is None else self.decay * old + (1.0 - self.decay) * sample

    def ratio(self, batch: int) -> float:
        """R(batch): a drafting step's cost in plain steps (>= 1)."""
        b = self.bucket(batch)
        plain, draft = self._per_request.get((b, False)), self._per_request.get((b, True))
        if plain is None or draft is None:
            return self.default_ratio
        return max(1.0, draft / plain)
