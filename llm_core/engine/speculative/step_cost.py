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
steps are measured, the others follow that level's measured overhead, scaled by the default's shape in
K. On a fresh bucket the default is the demo model's shape on the current code (text, K = 1 / 2 / 3,
thread CPU ms per request, plain vs drafting step, single runs on the shared box): b1 about 1.6-2.1
at K = 3, b8 2.4-4.1, b32 2.75 / 3.9 / 4.5 -- the jump past K = 1 at b32 is the verify leaving the
one-call layer (more than MAX_ROWS = 64 rows):

    R_default(B, K) = 1 + s(B) * per_token * K * (past_rows if B * (1 + K) > MAX_ROWS else 1)
    s(B) = min(1 + 0.4 * log2(B), 3)

It is a little optimistic on purpose, so that a fresh engine tries K = 1 at any batch size on an
optimistic prior and measures it (one step; captions at b32 gain from it), while K = 2-3 at b32 (96-128
rows part by part) stays shut on the prior alone -- the costly first verify the old flat default of
2.0 let through at every batch size.
"""

from __future__ import annotations

import math

from kernels.native.decoder_layer import MAX_ROWS


class StepCost:
    def __init__(self, *, per_token: float = 0.3, past_rows: float = 1.6, decay: float = 0.8) -> None:
        if per_token < 0.0 or past_rows < 1.0:
            raise ValueError(f"step cost defaults: per_token must be >= 0 and past_rows >= 1, got {per_token}, "
                             f"{past_rows}")
        self.per_token, self.past_rows, self.decay = per_token, past_rows, decay
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
            if levels:  # the nearest measured level's overhead, scaled by the default's shape in K
                k = min(levels, key=lambda k: (abs(k - draft), k))
                extra = max(0.0, self._per_request[(b, k)] / plain - 1.0)
                return 1.0 + extra * self._shape(batch, draft) / self._shape(batch, k)
        return self.default(batch, draft)

    def default(self, batch: int, draft: int) -> float:
        """R_default(batch, draft) (module docstring)."""
        scale = min(1.0 + 0.4 * math.log2(max(1, batch)), 3.0)
        return 1.0 + scale * self.per_token * self._shape(batch, draft)

    def _shape(self, batch: int, draft: int) -> float:
        """The default's extra cost in K, up to a factor (> 0 for K >= 1)."""
        return draft * (self.past_rows if batch * (1 + draft) > MAX_ROWS else 1.0)
