"""RMSNorm as MiMo-V2 uses it: normalise in fp32, scale by the weight (no +1 offset)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ATen's fused rms_norm computes x * rsqrt(mean(x^2) + eps) in one kernel: the same values,
        # bit for bit, as the four-op form transformers writes (pinned by a test), at one dispatch
        dtype = x.dtype
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
