"""One request's place in its grammar, and the logits mask it gives each step.

    sampler (processed_rows)   mask_logits(rows, states): the tokens each constrained row's grammar
                               cannot take next -> -inf (xgrammar's token bitmask), after logit_bias
                               and the penalties, before temperature / top-k / top-p
    engine (append_token)      state.accept(token): the grammar moves on; a token it rejects (only
                               possible if the mask was bypassed) ends the request with an error
    engine (check_stop)        state.terminated: the grammar is complete and its stop token was
                               taken -> finish_reason "stop" (also under ignore_eos)

Phases with a reasoning gate (params.py): FREE (thinking: any token but a stop token -- the answer
the constraint is for must still come) -> ANSWER (the grammar), or START (the grammar's tokens or
``<think>``) -> FREE or ANSWER.
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch

from llm_core.engine.structured.params import StructuredOutputsParams


class Phase(enum.Enum):
    START = "start"  # first token: the grammar's, or <think>
    FREE = "free"  # inside <think>...</think>: any token but a stop token
    ANSWER = "answer"  # the grammar holds


class GrammarState:
    """A request's grammar matcher and gate phase (module docstring)."""

    def __init__(self, compiled, params: StructuredOutputsParams, prompt_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.params = params
        self._matcher = xgr.GrammarMatcher(compiled)
        thinking = None if params.reasoning is None else params.reasoning.prompt_thinking(prompt_ids)
        self.phase = {None: Phase.START, "open": Phase.FREE, "closed": Phase.ANSWER}[thinking] \
            if params.reasoning is not None else Phase.ANSWER

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.phase is Phase.ANSWER and self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next-token bitmask of this request into ``bitmask[row]``."""
        if self.phase is Phase.FREE:
            bitmask[row] = -1  # every bit
            for stop in self._matcher.stop_token_ids:
                _set_bit(bitmask, row, stop, False)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.phase is Phase.START:
            _set_bit(bitmask, row, self.params.reasoning.start_id, True)

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``, the request's new output token; a ValueError if the grammar
        cannot take it."""
        gate = self.params.reasoning
        if self.phase is Phase.FREE:
            if token_id == gate.end_id:
                self.phase = Phase.ANSWER
            return
        if self.phase is Phase.START:
            if token_id == gate.start_id:
                self.phase = Phase.FREE
                return
            self.phase = Phase.ANSWER
        if not self._matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} does not follow the request's structured_outputs.{self.params.kind}")


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int, allowed: bool) -> None:
    """Set or clear ``token_id``'s bit in an int32 bitmask row (bit 31 is the sign bit)."""
    word, bit = divmod(token_id, 32)
    if word < bitmask.shape[1]:
        value = (1 << bit) if bit < 31 else -(1 << 31)
        if allowed:
            bitmask[row, word] |= value
        else:
            bitmask[row, word] &= ~value


def mask_logits(x: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState | None]) -> None:
    """In place: for each ``rows[j]`` (with its ``states[j]``), the tokens its grammar cannot take
    next get logit -inf (one bitmask for the batch, one apply)."""
    picked = [(r, s) for r, s in zip(rows, states) if s is not None]
    if not picked:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(x.shape[0], x.shape[1])
    for r, s in picked:
        s.fill(bitmask, r)
    xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device), vocab_size=x.shape[1], indices=[r for r, _ in picked])
