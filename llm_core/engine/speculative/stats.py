"""Counters of speculative decoding, read into EngineStats (``mmserve_spec_*`` on /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Engine-thread counters. ``accepted_length[a]`` counts verify steps of one request that accepted
    ``a`` draft tokens (so emitted ``a + 1`` tokens); index 0..max draft tokens."""

    max_draft_tokens: int
    draft_tokens: int = 0  # proposed
    accepted_tokens: int = 0  # proposed and accepted
    verify_steps: int = 0  # (request, step) pairs that verified at least one draft token
    accepted_length: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_length = [0] * (self.max_draft_tokens + 1)

    def record(self, drafted: int, accepted: int) -> None:
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_steps += 1
        self.accepted_length[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the bonus token)."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0
