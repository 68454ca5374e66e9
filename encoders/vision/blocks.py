"""One ViT block of the MiMo-V2.5 vision tower: pre-norm attention + SwiGLU MLP.

    x += attn.proj( attention( rope(q), rope(k), v ) )      attention: full or ±window band (+ sinks)
    x += mlp.down_proj( silu(gate_proj(n)) * up_proj(n) )    n = norm2(x)

Parameter names follow the checkpoint: ``norm1``, ``norm2``, ``attn.qkv`` (fused, contiguous
[q Hq*D | k Hkv*D | v Hkv*D], with bias), ``attn.proj``, ``attn.sinks`` [Hq] (windowed blocks only),
``mlp.{gate,up,down}_proj`` (with biases).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoders.config import VisionConfig
from encoders.rotary import apply_rotary
from kernels import ops


class VisionAttention(nn.Module):
    """GQA self-attention over packed frames; ``window=None`` = whole frame."""

    def __init__(self, config: VisionConfig, *, with_sinks: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv = nn.Linear(config.hidden_size, config.qkv_size, bias=True, device=device, dtype=dtype)
        self.proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=True, device=device,
                              dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads, device=device, dtype=dtype)) if with_sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                window: int | None) -> torch.Tensor:
        n = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.qkv(x)
        # q and k sit side by side in the fused projection: one rotary pass over their Hq + Hkv heads
        # (views into its result) instead of one per tensor; the arithmetic per head is the same.
        qk = apply_rotary(qkv[:, :q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim),
                          cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(n, self.num_kv_heads, self.head_dim)
        out = ops.band_attention(q, k, v, cu_seqlens, scale=self.scale, window=window, sinks=self.sinks)
        return self.proj(out.reshape(n, q_size))


class VisionMLP(nn.Module):
    """SwiGLU with biases."""

    def __init__(self, config: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=True, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=True, device=device, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place: fresh large CPU tensors cost page faults, not just bandwidth.
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class VisionBlock(nn.Module):
    """Pre-norm block; its attention kind (full / row / col window) is decided by the tower."""

    def __init__(self, config: VisionConfig, *, with_sinks: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, device=device, dtype=dtype)
        self.norm2 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, device=device, dtype=dtype)
        self.attn = VisionAttention(config, with_sinks=with_sinks, device=device, dtype=dtype)
        self.mlp = VisionMLP(config, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                window: int | None) -> torch.Tensor:
        """Updates ``x`` in place (the tower owns it) and returns it."""
        x.add_(self.attn(self.norm1(x), cos, sin, cu_seqlens, window))
        return x.add_(self.mlp(self.norm2(x)))
