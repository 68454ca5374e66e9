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
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # fp32: the weight goes into the same kernel (one dispatch, not four), still bit for bit
            # the same values (pinned by a test); other dtypes round h to dtype before the weight
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
