"""The 2x2 patch merger: one LLM-sized embedding per merge unit.

    tokens of one unit (4 x hidden, contiguous in row order) --ln_q--> concat (4*hidden)
        --> mlp.0 (Linear) --> GELU (exact) --> mlp.2 (Linear) --> out_hidden

Checkpoint names: ``merger.ln_q.weight`` (RMSNorm), ``merger.mlp.0.weight``, ``merger.mlp.2.weight``
(no biases in the checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from encoders.config import VisionConfig


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.unit_dim = config.hidden_size * config.merge_unit
        self.ln_q = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.Linear(self.unit_dim, self.unit_dim, bias=False, device=device, dtype=dtype),
            nn.GELU(),
            nn.Linear(self.unit_dim, config.out_hidden_size, bias=False, device=device, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] in row order (N a multiple of the unit) -> [N / unit, out_hidden]."""
        return self.mlp(self.ln_q(x).reshape(-1, self.unit_dim))
