"""Our audio encoder (``audio_encoder.*``): log-mel segments -> LLM-sized audio tokens.

    mel [T, n_mels] --conv1 (k3) + GELU--> --conv2 (k3, stride 2) + GELU-->  [n1, d]      50 Hz
      --layers (per config.layer_types: "full" / "sliding" ±window, bidirectional)--> layer_norm
      --avg pool (avg_pooler)--> [n2, d]                                                  25 Hz
      --groups of group_size rows, concatenated--> [G, group_size*d]
      --projection.mlp (Linear, GELU, Linear)--> [G, out_hidden]                          6.25 Hz

Every segment (<= ``segment_size`` mel frames) is encoded on its own: positions restart and no
attention, conv tap or pool crosses a segment. The real MiMo-V2.5 audio path (RVQ tokenizer + input
local transformer, docs/model.md §4) is not this; the names of the parts that exist in both
(``projection.mlp.{0,2}``, the tokenizer-style layer names) match.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio.blocks import AudioEncoderLayer
from encoders.audio.packing import AudioPackedBatch, encode_clips
from encoders.config import AudioConfig
from encoders.rotary import rotary_1d


class AudioProjection(nn.Module):
    """``projection.mlp``: one group of rows (group_size * width) -> hidden -> LLM hidden, no biases,
    exact GELU. Shared by our encoder and the reference path (same names and shapes there)."""

    def __init__(self, in_features: int, hidden: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_features, hidden, bias=False, device=device, dtype=dtype),
            nn.GELU(),
            nn.Linear(hidden, out_features, bias=False, device=device, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class AudioEncoder(nn.Module):
    def __init__(self, config: AudioConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        d, k = config.d_model, config.kernel_size
        self.conv1 = nn.Conv1d(config.n_mels, d, k, padding=k // 2, device=device, dtype=dtype)
        self.conv2 = nn.Conv1d(d, d, k, stride=config.stride_size, padding=k // 2, device=device, dtype=dtype)
        self.layers = nn.ModuleList(AudioEncoderLayer(config, device=device, dtype=dtype)
                                    for _ in range(config.num_layers))
        self.layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, device=device, dtype=dtype)
        self.projection = AudioProjection(config.group_size * d, config.projection_hidden_size,
                                          config.out_hidden_size, device=device, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.conv1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.conv1.weight.dtype

    @torch.no_grad()
    def forward_packed(self, batch: AudioPackedBatch) -> torch.Tensor:
        """Run a packed batch -> [sum of tokens, out_hidden] in segment order."""
        cfg = self.config
        x = F.gelu(self.conv1(batch.mel.to(self.dtype)[None]))[0]  # [d, L]
        # Zero the gaps: they are the next conv's padding. masked_fill, not a multiply by the mask:
        # NaN * 0 is NaN, so one segment with a non-finite frame would leak it through the gap into
        # its neighbours' conv2 taps -- other requests' audio in the same packed batch.
        x = x.masked_fill(~batch.gap_mask, 0.0)
        x = F.gelu(self.conv2(x[None]))[0]  # [d, L / stride]
        x = x.transpose(0, 1)[batch.conv_index]  # [N, d]
        cos, sin = rotary_1d(batch.positions, cfg.head_dim, cfg.rope_theta)
        for layer, kind in zip(self.layers, cfg.layer_types):
            x = layer(x, cos, sin, batch.cu_seqlens, cfg.attention_window if kind == "sliding" else None)
        x = self.layer_norm(x)
        pooled = x.new_zeros(batch.pool_count.shape[0], x.shape[1]).index_add_(0, batch.pool_index, x)
        pooled = pooled / batch.pool_count.to(x.dtype)[:, None]
        groups = pooled[batch.group_index].reshape(-1, cfg.group_size * cfg.d_model)
        return self.projection(groups)

    @torch.no_grad()
    def encode_segments(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Encode mel segments (each <= segment_size frames) in one packed forward -> per segment."""
        if not segments:
            return []
        batch = AudioPackedBatch.build([s.to(self.device) for s in segments], self.config)
        return batch.split(self.forward_packed(batch))

    @torch.no_grad()
    def forward(self, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Encode whole clips (log-mels [T, n_mels]); long clips are cut into segments first."""
        return encode_clips(mels, self.config.segment_size, self.encode_segments)
