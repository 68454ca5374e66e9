"""What one engine step computes: the scheduler's output and the model runner's input. Each entry is
a request and the span of its tokens computed this step (``start`` .. ``end``): a prompt chunk, a
decode token, or an MTP verify span whose last ``num_draft_tokens`` are drafts proposed at step time."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_core.engine.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    # Speculative decoding: the last num_draft_tokens of the new tokens are drafts the model runner
    # proposes at step time (llm_core/engine/speculative/); pages are allocated for all of them.
    num_draft_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so the step samples a new one."""
        return self.end == self.request.num_tokens


@dataclass
class ScheduledBatch:
    entries: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # finished with an error by the scheduler

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)
