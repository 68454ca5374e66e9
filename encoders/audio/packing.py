"""Packed variable-length batches for the audio encoder.

A clip's log-mel is cut into fixed ``segment_size`` segments (+ remainder) that encode independently
(positions restart), so segments can be cached and streamed. Many segments of many clips run as one
batch without padding to the longest:

1. Convolutions run once over one long time axis. Segments sit at offsets that are multiples of the
   conv stride, separated by at least ``kernel // 2`` zero frames, so no kernel tap reaches a
   neighbour (the gaps are re-zeroed after conv1 because GELU(bias) != 0):

       mel axis:   [seg0: T0 ][0][seg1: T1  ][0 0][seg2 ...      offsets a_i % stride == 0
       conv2 out:  [n1_0]      [n1_1]           ...              seg i outputs start at a_i / stride

2. The transformer sees only the valid conv outputs, packed with ``cu_seqlens`` per segment.
3. Avg pool (``avg_pooler`` frames -> 1, a short tail is averaged alone) and grouping
   (``group_size`` pooled rows -> one token; a short last group repeats its last row) are gathers:

       pooled rows of a segment:  r0 r1 r2 r3 r4      group 4 -> tokens [r0 r1 r2 r3] [r4 r4 r4 r4]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from encoders.config import AudioConfig


def split_segments(mel: torch.Tensor, segment_size: int) -> list[torch.Tensor]:
    """Cut a log-mel [T, n_mels] into consecutive segments of ``segment_size`` frames (+ remainder)."""
    if mel.dim() != 2 or mel.shape[0] == 0:
        raise ValueError(f"a log-mel must be [T>0, n_mels], got shape {tuple(mel.shape)}")
    return list(torch.split(mel, segment_size))


def encode_clips(mels: Sequence[torch.Tensor], segment_size: int,
                 encode_segments: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """Whole clips through a segment encoder: every clip cut into segments, all segments encoded in
    one call (one batch across clips), the rows put back together per clip."""
    pieces = [split_segments(m, segment_size) for m in mels]
    outs = encode_segments([s for p in pieces for s in p])
    result, i = [], 0
    for p in pieces:
        result.append(torch.cat(outs[i:i + len(p)]))
        i += len(p)
    return result


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class AudioPackedBatch:
    """Index plan for running several mel segments as one batch (see module doc)."""

    mel: torch.Tensor  # [n_mels, L] all segments on one zero-gapped time axis
    gap_mask: torch.Tensor  # [L] bool, True inside a segment (conv1 output kept)
    conv_index: torch.Tensor  # [N] conv2 output column of every transformer token
    cu_seqlens: torch.Tensor  # [S + 1] int64 over transformer tokens
    positions: torch.Tensor  # [N] position inside its segment (rotary)
    pool_index: torch.Tensor  # [N] pooled row each token averages into
    pool_count: torch.Tensor  # [P] frames per pooled row (float)
    group_index: torch.Tensor  # [G * group_size] pooled row feeding each group slot
    tokens_per_segment: tuple[int, ...]

    @classmethod
    def build(cls, segments: Sequence[torch.Tensor], config: AudioConfig) -> "AudioPackedBatch":
        if not segments:
            raise ValueError("an audio batch needs at least one segment")
        stride, pad = config.stride_size, config.kernel_size // 2
        lengths = []
        for s in segments:
            if s.dim() != 2 or s.shape[1] != config.n_mels or s.shape[0] == 0:
                raise ValueError(f"audio segments must be [T>0, {config.n_mels}], got {tuple(s.shape)}")
            if s.shape[0] > config.segment_size:
                raise ValueError(f"segment of {s.shape[0]} frames exceeds segment_size {config.segment_size}; "
                                 f"cut it with split_segments")
            lengths.append(int(s.shape[0]))
        offsets, cursor = [], 0
        for n in lengths:
            offsets.append(cursor)
            cursor = _round_up(cursor + n + pad, stride)
        total = offsets[-1] + lengths[-1]
        device = segments[0].device
        mel = torch.zeros(config.n_mels, total, device=device, dtype=torch.float32)
        gap_mask = torch.zeros(total, dtype=torch.bool, device=device)
        for a, s in zip(offsets, segments):
            mel[:, a:a + s.shape[0]] = s.transpose(0, 1)
            gap_mask[a:a + s.shape[0]] = True

        conv_idx, pos, pool_idx, pool_cnt, group_idx, tokens = [], [], [], [], [], []
        pooled_base = 0
        for a, n in zip(offsets, lengths):
            n1 = config.conv_frames(n)
            n2 = -(-n1 // config.avg_pooler)
            g = -(-n2 // config.group_size)
            local = torch.arange(n1)
            conv_idx.append(a // stride + local)
            pos.append(local)
            pool_idx.append(pooled_base + local // config.avg_pooler)
            pool_cnt.append(torch.bincount(local // config.avg_pooler, minlength=n2))
            group_idx.append(pooled_base + torch.clamp(torch.arange(g * config.group_size), max=n2 - 1))
            tokens.append(g)
            pooled_base += n2
        n1s = torch.tensor([len(p) for p in pos])
        return cls(
            mel=mel,
            gap_mask=gap_mask,
            conv_index=torch.cat(conv_idx).to(device),
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), n1s.cumsum(0)]).to(device),
            positions=torch.cat(pos).to(device),
            pool_index=torch.cat(pool_idx).to(device),
            pool_count=torch.cat(pool_cnt).float().to(device),
            group_index=torch.cat(group_idx).to(device),
            tokens_per_segment=tuple(tokens),
        )

    def split(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Per-segment views of the projection output [sum tokens, out_hidden]."""
        return list(torch.split(tokens, list(self.tokens_per_segment)))
