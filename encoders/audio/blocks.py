"""One transformer layer of the audio encoder (pre-LayerNorm, GELU MLP, rotary attention).

    x += self_attn.out_proj( attention( rope(q), rope(k), v ) )   n = self_attn_layer_norm(x)
    x += fc2( gelu( fc1( final_layer_norm(x) ) ) )

Attention is bidirectional within a segment: "full" sees the whole segment, "sliding" a symmetric
±``attention_window`` band (kernels.ops.band_attention). Names follow the MiMo audio tokenizer's
encoder layers (``self_attn.{q,k,v,out}_proj``, ``self_attn_layer_norm``, ``final_layer_norm``, ``fc1``,
``fc2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoders.config import AudioConfig
from encoders.rotary import apply_rotary
from kernels import ops


class AudioAttention(nn.Module):
    def __init__(self, config: AudioConfig, device=None, dtype=None) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.q_proj = nn.Linear(d, d, bias=True, device=device, dtype=dtype)
        self.k_proj = nn.Linear(d, d, bias=True, device=device, dtype=dtype)
        self.v_proj = nn.Linear(d, d, bias=True, device=device, dtype=dtype)
        self.out_proj = nn.Linear(d, d, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                window: int | None) -> torch.Tensor:
        n = x.shape[0]
        shape = (n, self.num_heads, self.head_dim)
        q = apply_rotary(self.q_proj(x).view(shape), cos, sin)
        k = apply_rotary(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        out = ops.band_attention(q, k, v, cu_seqlens, scale=self.scale, window=window)
        return self.out_proj(out.reshape(n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: AudioConfig, device=None, dtype=None) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, device=device, dtype=dtype)
        self.self_attn = AudioAttention(config, device=device, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, device=device, dtype=dtype)
        self.fc1 = nn.Linear(d, config.ffn_dim, bias=True, device=device, dtype=dtype)
        self.fc2 = nn.Linear(config.ffn_dim, d, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                window: int | None) -> torch.Tensor:
        """Updates ``x`` in place (the encoder owns it) and returns it."""
        x.add_(self.self_attn(self.self_attn_layer_norm(x), cos, sin, cu_seqlens, window))
        return x.add_(self.fc2(F.gelu(self.fc1(self.final_layer_norm(x)))))
