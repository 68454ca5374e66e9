"""Expert placement for the MoE block: which experts (and which slice of their intermediate dim) this
rank holds, and the combine of the ranks' partial outputs.

Every rank sees every token (attention output is replicated), and routing is computed on every rank
from the same fp32 router and the same inputs, so each rank's choice equals one process's. A rank then
runs only the (token, expert) assignments that land on its experts:

    ids   [T, k]  global expert ids      local = id - lo where lo <= id < hi, else E_local (skipped)
    out   = fused experts over the local ids (skipped entries add nothing; no host read of which
            entries are local), then all-reduce over the world (sum of every rank's share)

With moe_tp > 1 each rank holds I / moe_tp columns of gate/up and rows of down for its experts; the
SiLU-gated product is elementwise in I, so the partial down projections also just sum.
"""

from __future__ import annotations

import torch

from kernels import ops
from llm_core.distributed.parallel_context import ParallelContext


class ExpertShard:
    """This rank's experts [lo, hi) and the dispatch / combine around the stacked expert kernels."""

    def __init__(self, num_experts: int, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.lo, self.hi = ctx.expert_range(num_experts)
        self.num_local = self.hi - self.lo

    def __call__(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            return ops.fused_experts(x, w_gate_up, w_down, weights, ids)
        if self.ctx.ep_size == 1:  # every expert is here (its intermediate slice): no dispatch
            out = ops.fused_experts(x, w_gate_up, w_down, weights, ids)
        else:
            out = self._local_share(x, w_gate_up, w_down, weights, ids)
        return self.ctx.all_reduce_moe(out.to(x.dtype))

    def _local_share(self, x, w_gate_up, w_down, weights, ids) -> torch.Tensor:
        """This rank's experts' part of every token's output: ids become local ones, other ranks'
        experts the skipped id ``num_local`` (ops.fused_experts), all on the device -- selecting
        this rank's entries with ``nonzero`` read their count back to the host in every MoE layer."""
        local = ids - self.lo
        local = local.masked_fill((local < 0) | (local >= self.num_local), self.num_local)
        return ops.fused_experts(x, w_gate_up, w_down, weights, local, skipped=True)
