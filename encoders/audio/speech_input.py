"""From RVQ codes to LLM embeddings: the main checkpoint's ``speech_embeddings.*`` and
``audio_encoder.*`` (docs/model.md §2.4, §4 steps 4-7).

    codes [T, >= C]  --first C channels; T padded to a multiple of group_size by repeating the last row-->
    [G, group, C] --sum over c of speech_embeddings[c][code]--> [G, group, dim]
      --input_local_transformer (Qwen2 layers, bidirectional inside a group, positions 0..group-1,
        final RMSNorm)--> [G, group, dim] --reshape--> [G, group * dim]
      --projection.mlp (Linear, GELU, Linear; no biases)--> [G, out_hidden]   one row per <|audio_pad|>
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio.encoder import AudioProjection
from encoders.audio.mimo_config import SpeechInputConfig
from encoders.rotary import apply_rotary, rotary_1d


class RMSNorm(nn.Module):
    """Qwen2's RMSNorm: normalise in fp32, then scale by the weight (no offset)."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LocalAttention(nn.Module):
    def __init__(self, cfg: SpeechInputConfig, device=None, dtype=None) -> None:
        super().__init__()
        d, inner = cfg.input_local_dim, cfg.input_local_attn_heads * cfg.input_local_head_dim
        self.num_heads, self.head_dim = cfg.input_local_attn_heads, cfg.input_local_head_dim
        self.causal = not cfg.input_full_attention
        self.q_proj = nn.Linear(d, inner, bias=True, device=device, dtype=dtype)
        self.k_proj = nn.Linear(d, inner, bias=True, device=device, dtype=dtype)
        self.v_proj = nn.Linear(d, inner, bias=True, device=device, dtype=dtype)
        self.o_proj = nn.Linear(inner, d, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        g, n, _ = x.shape
        shape = (g * n, self.num_heads, self.head_dim)
        cos_f, sin_f = cos.repeat(g, 1), sin.repeat(g, 1)
        q = apply_rotary(self.q_proj(x).reshape(shape), cos_f, sin_f).view(g, n, self.num_heads, -1)
        k = apply_rotary(self.k_proj(x).reshape(shape), cos_f, sin_f).view(g, n, self.num_heads, -1)
        v = self.v_proj(x).view(g, n, self.num_heads, -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=self.causal)
        return self.o_proj(out.transpose(1, 2).reshape(g, n, -1))


class LocalMLP(nn.Module):
    def __init__(self, cfg: SpeechInputConfig, device=None, dtype=None) -> None:
        super().__init__()
        d, f = cfg.input_local_dim, cfg.input_local_intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(d, f, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(f, d, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LocalLayer(nn.Module):
    def __init__(self, cfg: SpeechInputConfig, device=None, dtype=None) -> None:
        super().__init__()
        d, eps = cfg.input_local_dim, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, device=device, dtype=dtype)
        self.self_attn = LocalAttention(cfg, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, device=device, dtype=dtype)
        self.mlp = LocalMLP(cfg, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class InputLocalTransformer(nn.Module):
    """``audio_encoder.input_local_transformer``: a Qwen2 model without token embeddings, run as a
    batch of groups (sequence length = group_size)."""

    def __init__(self, cfg: SpeechInputConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(LocalLayer(cfg, device=device, dtype=dtype) for _ in range(cfg.input_local_layers))
        self.norm = RMSNorm(cfg.input_local_dim, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [G, group, dim] -> [G, group, dim]."""
        cfg = self.config
        cos, sin = rotary_1d(torch.arange(x.shape[1], device=x.device), cfg.input_local_head_dim, cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) if cfg.add_post_norm else x


class SpeechAudioEncoder(nn.Module):
    """``audio_encoder.*``: the local transformer and the projection."""

    def __init__(self, cfg: SpeechInputConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.input_local_transformer = InputLocalTransformer(cfg, device=device, dtype=dtype)
        self.projection = AudioProjection(cfg.group_size * cfg.input_local_dim, cfg.projection_hidden_size,
                                          cfg.out_hidden_size, device=device, dtype=dtype)


class SpeechInput(nn.Module):
    """``speech_embeddings.*`` + ``audio_encoder.*`` of the main checkpoint: codes -> embeddings."""

    def __init__(self, cfg: SpeechInputConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        self.speech_embeddings = nn.ModuleList(
            nn.Embedding(v, cfg.input_local_dim, device=device, dtype=dtype) for v in cfg.speech_vocab_size)
        self.audio_encoder = SpeechAudioEncoder(cfg, device=device, dtype=dtype)

    def group_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [T, >= C] -> [G, group_size, C]: the first C channels, T padded to a whole number
        of groups by repeating the last row (the reference's rule)."""
        cfg = self.config
        if codes.dim() != 2 or codes.shape[0] == 0 or codes.shape[1] < cfg.audio_channels:
            raise ValueError(f"audio codes must be [T>0, >={cfg.audio_channels}], got {tuple(codes.shape)}")
        codes = codes[:, :cfg.audio_channels].long()
        for c, size in enumerate(cfg.speech_vocab_size):
            col = codes[:, c]
            if int(col.min()) < 0 or int(col.max()) >= size:
                raise ValueError(f"audio codes of channel {c} must be in [0, {size}), got "
                                 f"[{int(col.min())}, {int(col.max())}]")
        pad = -codes.shape[0] % cfg.group_size
        if pad:
            codes = torch.cat([codes, codes[-1:].expand(pad, -1)])
        return codes.view(-1, cfg.group_size, cfg.audio_channels)

    @torch.no_grad()
    def forward(self, grouped: torch.Tensor) -> torch.Tensor:
        """Grouped codes [G, group_size, C] -> embeddings [G, out_hidden]."""
        grouped = grouped.to(self.speech_embeddings[0].weight.device)
        x = sum(emb(grouped[..., c]) for c, emb in enumerate(self.speech_embeddings))
        x = self.audio_encoder.input_local_transformer(x)
        return self.audio_encoder.projection(x.reshape(x.shape[0], -1))
