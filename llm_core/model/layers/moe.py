"""Sigmoid-routed mixture of experts (MiMo-V2 / DeepSeek-V3 "noaux_tc" routing, no shared experts).

Routing runs in fp32 whatever the model dtype (the checkpoint stores the router in fp32):
  scores = sigmoid(x W_gate^T);  choose top-k of scores + e_score_correction_bias (bias only chooses,
  optionally inside the best ``topk_group`` of ``n_group`` groups); weights = chosen unbiased scores,
  renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
Experts are stacked so one kernel call runs them all: gate_up_proj [E, 2I, H] (gate rows, then up
rows), down_proj [E, H, I]. Checkpoints store them per expert; the loader stacks them -- in the
model's dtype, or, with ``ModelConfig.expert_fp8_block``, as block-FP8 values and block factors (half the
bytes of bf16; the Triton expert kernels read them as stored).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels import ops
from kernels.block_fp8 import FP8_DTYPE, BlockFP8
from kernels.cpu.moe import native_serves
from kernels.native.moe_experts import moe_route_experts
from llm_core.distributed.expert_parallel import ExpertShard
from llm_core.distributed.parallel_context import ParallelContext
from llm_core.model.config import ModelConfig


class Router(nn.Module):
    """The ``mlp.gate`` module: fp32 weight [E, H] and the fp32 correction bias [E]."""

    FP32 = True  # the loader keeps this module's tensors in fp32 whatever the model dtype

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] in fp32."""
        # .float() only where needed: on an fp32 tensor it is still one (no-op) dispatch per layer
        return F.linear(x if x.dtype == torch.float32 else x.float(), self.weight.float())


class StackedExperts(nn.Module):
    """The experts' weights, stacked: in the model's dtype, or (``fp8_block``) kept as block-FP8
    values with one fp32 factor per (bn x bk) block (kernels/block_fp8.py; the gate and up rows of
    gate_up_proj blocked as two groups, like the checkpoint's separate gate_proj / up_proj)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.fp8_block = fp8_block
        if fp8_block is None:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
            self.down_proj = nn.Parameter(torch.empty(e, h, i))
            return
        bn, bk = fp8_block
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8_DTYPE), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=FP8_DTYPE), requires_grad=False)
        self.register_buffer("gate_up_scale_inv", torch.empty(e, 2 * -(-i // bn), -(-h // bk)))
        self.register_buffer("down_scale_inv", torch.empty(e, -(-h // bn), -(-i // bk)))

    def operands(self) -> tuple[torch.Tensor | BlockFP8, torch.Tensor | BlockFP8]:
        """(gate_up, down) as ``ops.fused_experts`` takes them."""
        if self.fp8_block is None:
            return self.gate_up_proj, self.down_proj
        return (BlockFP8(self.gate_up_proj, self.gate_up_scale_inv, self.fp8_block, groups=2),
                BlockFP8(self.down_proj, self.down_scale_inv, self.fp8_block))

    def use_kernel_layout_(self) -> None:
        """Re-lay both stacks in the layout the device's expert kernel reads fastest (same shapes and
        values; ``kernels.ops.expert_weight_layout``). Called once by the model runner after loading.
        Block-FP8 stacks stay as stored (the CPU paths dequantise them per call anyway)."""
        if self.fp8_block is not None:
            return
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self, name)
            p.data = ops.expert_weight_layout(p.data)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext.single()
        # Expert placement (which experts, which intermediate slice) and the combine across ranks
        # belong to the expert-parallel helper; the router stays whole on every rank.
        self.placement = ExpertShard(config.num_experts, parallel)
        i0, i1 = parallel.moe_inter_range(config.moe_intermediate_size)
        self.top_k = config.top_k
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.renormalize = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = Router(config.num_experts, config.hidden_size)
        self.experts = StackedExperts(self.placement.num_local, config.hidden_size, i1 - i0,
                                      config.expert_fp8_block)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' sum for x's rows, plus ``residual`` when given (the decoder layer's residual
        add, in the same C call when it serves)."""
        out = self._native(x, residual)
        if out is not None:
            return out
        out = self._torch(x)
        return out if residual is None else residual + out

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.route(
            self.gate(x),
            self.gate.e_score_correction_bias,
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        return self.placement(x, *self.experts.operands(), weights, ids)

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """Router and experts in one C call (kernels/native/moe_experts.c) for the steps the C experts
        kernel serves anyway, on one rank, eager; None: the torch router serves."""
        if (self.placement.ctx.world_size != 1 or not x.is_cpu or torch.compiler.is_compiling()
                or self.experts.fp8_block is not None or not native_serves(x.shape[0], self.top_k, x.shape[-1])):
            return None
        return moe_route_experts(x, self.gate.weight, self.gate.e_score_correction_bias, self.experts.gate_up_proj,
                                 self.experts.down_proj, top_k=self.top_k, n_group=self.n_group,
                                 topk_group=self.topk_group, renormalize=self.renormalize,
                                 routed_scaling_factor=self.routed_scaling_factor, residual=residual)
