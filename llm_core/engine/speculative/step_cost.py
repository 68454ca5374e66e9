"""StepCost: what a decode step drafting up to K tokens per request costs next to a plain one, measured.

Drafting pays when the tokens it adds outweigh what it costs, and on a CPU much of the cost is per
*step*, not per draft row: once any request of a batch drafts, the step runs the MTP draft, the MTP
extend, the verify rows and their inputs. How much depends on the batch size and on K, the step's
largest draft length: the verify rows are R x (1 + K), and past the one-call layer's 64 rows
(llm_core/model/layers/fused_decode.py) a step falls back to the layer part by part. So the policy
(adaptive.py) needs, per batch size B and K,

    R(B, K) = (CPU time per request of a decode step drafting up to K tokens) / (... of a plain step)

which SpeculativeRunner measures on the engine thread (``time.thread_time``, which other processes do
not inflate) for every step whose entries are all decodes (a prefill chunk would dominate the time).
Batch sizes are bucketed by powers of two; each (bucket, K) keeps an exponential moving average.

**Before a level is measured** R is estimated. Once any drafting level of the bucket and its plain
steps are measured, the others follow that level's measured overhead, in proportion to K. On a fresh
bucket the default is R_default(K) = 1 + per_token * K (2.0 at K = 3, the old flat default), the same
at every batch size: an optimistic start that lets the first steps of a fresh engine draft and so
measure. A pessimistic default that grew with the batch (R_default(32, 3) ~ 5, shaped on text) was
tried and lost captions at b32 (1.69x -> 1.0x, medians of 4): their long media contexts make a plain
step dear, so a 19-request step drafting 3 tokens measured only ~2.5 plain steps there, while on text
at b32 the gate had already shut before the decode steps (the prior learned from the first verify).
"""

from __future__ import annotations


class StepCost:
    def __init__(self, *, per_token: float = 1.0 / 3.0, decay: float = 0.8) -> None:
        if per_token < 0.0:
            raise ValueError(f"step cost default per draft token must be >= 0, got {per_token}")
        self.per_token, self.decay = per_token, decay
        self._per_request: dict[tuple[int, int], float] = {}  # (bucket, K; 0 = plain) -> seconds per request

    @staticmethod
    def bucket(batch: int) -> int:
        return max(1, batch).bit_length()  # 1 | 2-3 | 4-7 | 8-15 | 16-31 | 32-63 | ...

    def record(self, batch: int, draft: int, seconds: float) -> None:
        """One decode-only step of ``batch`` requests took ``seconds``; ``draft``: its largest draft
        length (0: a plain step)."""
        if batch <= 0 or seconds <= 0.0 or draft < 0:
            return
        key = (self.bucket(batch), int(draft))
        sample = seconds / batch
        old = self._per_request.get(key)
        self._per_request[key] = sample if old is None else self.decay * old + (1.0 - self.decay) * sample

    def measured(self, batch: int, draft: int) -> bool:
        """Whether R(batch, draft) comes from this bucket's own steps (plain and that level)."""
        b = self.bucket(batch)
        return (b, 0) in self._per_request and (b, draft) in self._per_request

    def ratio(self, batch: int, draft: int) -> float:
        """R(batch, draft): a step drafting up to ``draft`` tokens, in plain steps (>= 1; 1 at 0)."""
        if draft <= 0:
            return 1.0
        b = self.bucket(batch)
        plain = self._per_request.get((b, 0))
        if plain is not None:
            if (b, draft) in self._per_request:
                return max(1.0, self._per_request[(b, draft)] / plain)
            levels = [k for (bb, k) in self._per_request if bb == b and k > 0]
            if levels:  # the nearest measured level's overhead, in proportion to K
                k = min(levels, key=lambda k: (abs(k - draft), k))
                extra = max(0.0, self._per_request[(b, k)] / plain - 1.0)
                return 1.0 + extra * draft / k
        return self.default(batch, draft)

    def default(self, batch: int, draft: int) -> float:
        """R_default(draft) (module docstring; the same at every batch size)."""
        return 1.0 + self.per_token * max(0, draft)
