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
K. On a fresh bucket the default is the demo model's shape on the current code (one-call decode layer
for plain and verify steps, C draft; text, K = 1 / 2 / 3, thread CPU ms per request, plain vs
drafting step): b1 about 2.1 at K = 3 (0.91 -> 1.48 text, 1.31 -> 2.80 captions), b8 2.4-4.1 (1.1-1.6
ms plain steps against 3.6-4.7), b32 2.75 / 3.9 / 4.5:

    R_default(B, K) = 1 + s(B) * (overhead + per_token * K),   s(B) = min(1 + log2(B) / 3, scale_cap)

so a fresh engine does not open a 128-row verify step at batch 32 on an optimistic prior (the step the
old flat default of 2.0 let through first), yet drafts at batch 1 right away.
"""

from __future__ import annotations

import math


class StepCost:
    def __init__(self, *, overhead: float = 0.5, per_token: float = 0.25, scale_cap: float = 2.7,
                 decay: float = 0.8) -> None:
        if overhead < 0.0 or per_token < 0.0 or scale_cap < 1.0:
            raise ValueError(f"step cost defaults must be >= 0 (scale cap >= 1), got overhead={overhead}, "
                             f"per_token={per_token}, scale_cap={scale_cap}")
        self.overhead, self.per_token, self.scale_cap, self.decay = overhead, per_token, scale_cap, decay
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
                shape = self._shape(k)
                return 1.0 + extra * (self._shape(draft) / shape if shape > 0.0 else 1.0)
        return self.default(batch, draft)

    def default(self, batch: int, draft: int) -> float:
        """R_default(batch, draft) (module docstring)."""
        scale = min(1.0 + math.log2(max(1, batch)) / 3.0, self.scale_cap)
        return 1.0 + scale * self._shape(draft)

    def _shape(self, draft: int) -> float:
        return self.overhead + self.per_token * draft
