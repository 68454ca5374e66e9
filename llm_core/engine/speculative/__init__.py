"""MTP speculative decoding: the checkpoint's own MTP layers draft, the target verifies in one step.

    proposer.py   MTPProposer: MTP KV for every computed row (the "extend"), k greedy draft tokens
    draft_steps.py DraftSteps: the first mode's k draft steps' inputs (batches, plans, rotary), built once
    verify.py     accepted prefix + one bonus token: greedy (exact match) or the plain sampler's draws
    adaptive.py   DraftLength: k per request from its recent acceptance and the batch size; the step gate
    acceptance_prior.py  AcceptancePrior: the engine-wide acceptance a new request starts from
    step_cost.py  StepCost: a drafting step's measured cost in plain steps, per batch size and draft cap
    runner.py     SpeculativeRunner: draft -> one target forward over 1 + k tokens -> verify
    stats.py      SpecStats: drafted / accepted counters and the accepted-length histogram

How a verify step goes, and how rejected KV is rolled back in both pools: docs/speculative.md.
"""

from llm_core.engine.speculative.runner import SpeculativeRunner, build_speculative

__all__ = ["SpeculativeRunner", "build_speculative"]
