"""Partial rotary position embedding (NeoX rotate-half) over the first ``rotary_dim`` dims of a head.

    head dims:  [ 0 ........ rotary_dim/2 ........ rotary_dim | rotary_dim ........ head_dim )
                 \\__ x1 __/ \\_______ x2 _______/               \\______ untouched ______/
    pairs (j, j + rotary_dim/2) rotate by angle  pos * theta^(-2j/rotary_dim)
"""

from __future__ import annotations

import torch
from torch import nn


class PartialRotary(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hk, D] at absolute ``positions`` [T]."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.theta = theta
        # Frequencies are recomputed per device on first use instead of being a buffer: the model is
        # built on the meta device and a non-persistent buffer would stay meta after loading.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            self._inv_freq[device] = 1.0 / (self.theta**exponent)
        return self._inv_freq[device]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == 0:
            return q, k
        freqs = positions.float()[:, None] * self.inv_freq(q.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, theta={self.theta}"
