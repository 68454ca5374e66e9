"""Video as a sequence of temporal groups (2 frames each) that encode independently.

Attention never crosses a temporal slice, so a video of G groups is exactly G one-group items:

    frames  f0 f1 | f2 f3 | f4 f5 | f6 (f6)      odd count: repeat the last frame (and its timestamp)
    groups  g0    | g1    | g2    | g3           grid per group (1, gh, gw); time = its first frame's

Encoding the groups one at a time, in any batch split, gives the rows of the whole-video encoding
(tested). This is what lets a long video stream into prefill group by group and be cached per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from encoders.image_processing import ImageProcessingConfig, normalize, patchify, resize_frames, smart_resize


def format_timestamp(seconds: float) -> str:
    """"MM:SS" of a group's first frame (integer floor, minutes not wrapped at 60)."""
    if seconds < 0:
        raise ValueError(f"timestamps must be >= 0, got {seconds}")
    total = int(seconds)
    return f"{total // 60:02d}:{total % 60:02d}"


@dataclass(frozen=True)
class VideoFrameGroups:
    """One video after preprocessing: per-group patch rows (each grid (1, gh, gw)) + timestamps."""

    rows: torch.Tensor  # [G * gh * gw, patch_dim]; group k = rows[k*gh*gw : (k+1)*gh*gw]
    grid_hw: tuple[int, int]
    timestamps: tuple[float, ...]  # seconds of each group's first frame

    @property
    def num_groups(self) -> int:
        return len(self.timestamps)

    @property
    def tokens_per_group(self) -> int:
        return self.grid_hw[0] * self.grid_hw[1]

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """Grid of the whole video as one item."""
        return self.num_groups, self.grid_hw[0], self.grid_hw[1]

    def group(self, k: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(rows, grid_thw) of group k, ready to pack as its own vision item."""
        if not 0 <= k < self.num_groups:
            raise IndexError(f"group {k} outside [0, {self.num_groups})")
        n = self.tokens_per_group
        return self.rows[k * n:(k + 1) * n], (1, *self.grid_hw)

    def groups(self, start: int = 0, stop: int | None = None) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        stop = self.num_groups if stop is None else stop
        return [self.group(k) for k in range(start, stop)]


def pad_to_groups(frames: torch.Tensor, timestamps: Sequence[float], temporal: int = 2
                  ) -> tuple[torch.Tensor, list[float]]:
    """Repeat the last frame (and its timestamp) until the count is a multiple of ``temporal``."""
    if frames.dim() != 4 or frames.shape[0] == 0:
        raise ValueError(f"video frames must be [T>0, C, H, W], got shape {tuple(frames.shape)}")
    if len(timestamps) != frames.shape[0]:
        raise ValueError(f"{frames.shape[0]} frames but {len(timestamps)} timestamps")
    stamps = [float(t) for t in timestamps]
    pad = (-frames.shape[0]) % temporal
    if pad:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        stamps += [stamps[-1]] * pad
    return frames, stamps


def preprocess_video(frames: torch.Tensor, timestamps: Sequence[float], config: ImageProcessingConfig
                     ) -> VideoFrameGroups:
    """Sampled 0-255 frames [T, C, H, W] + their times (s) -> frame groups (per-frame pixel budget
    of :meth:`ImageProcessingConfig.video_frame_max_pixels`)."""
    frames, stamps = pad_to_groups(frames, timestamps, config.temporal_patch_size)
    max_pixels = config.video_frame_max_pixels(frames.shape[0])
    h, w = smart_resize(frames.shape[-2], frames.shape[-1], config.factor, config.video_min_pixels, max_pixels)
    x = normalize(resize_frames(frames, h, w), config.mean, config.std)
    rows, (t, gh, gw) = patchify(x, config.patch_size, config.temporal_patch_size, config.merge_size)
    return VideoFrameGroups(rows=rows, grid_hw=(gh, gw), timestamps=tuple(stamps[::config.temporal_patch_size]))
