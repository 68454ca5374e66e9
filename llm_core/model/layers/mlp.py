"""Dense SwiGLU MLP: down(silu(gate x) * up x); column/row-parallel under tensor parallelism.

A decode step's few rows (up to ``MAX_ROWS``, fp32 CPU, one process) run as one C call
(kernels/native/decoder_layer.c, the residual add included) instead of five torch ops."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels.native.decoder_layer import MAX_ROWS, dense_mlp
from llm_core.distributed.parallel_context import ParallelContext
from llm_core.distributed.parallel_layers import column_linear, row_linear


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext.single()
        # gate/up column-parallel, down row-parallel: one all-reduce under tensor parallelism
        i0, i1 = parallel.tp_range(intermediate_size, "intermediate_size")
        self.gate_proj = column_linear(hidden_size, i1 - i0)
        self.up_proj = column_linear(hidden_size, i1 - i0)
        self.down_proj = row_linear(i1 - i0, hidden_size, parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate x) * up x), plus ``residual`` when given (the decoder layer's residual add)."""
        # a row-parallel down_proj (tensor parallelism) sums its ranks' outputs: the C call would not
        if (x.shape[0] <= MAX_ROWS and type(self.down_proj) is nn.Linear and x.is_cpu
                and not torch.compiler.is_compiling()):
            out = dense_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, residual)
            if out is not None:
                return out
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if residual is None else residual + out
