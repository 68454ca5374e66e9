"""Which source frames of a video the model sees (docs/model.md §3, qwen-vl ``smart_nframes``).

    n_raw = total_frames / video_fps * fps                    (frames at the target rate)
    n     = floor2( min( max(n_raw, ceil2(min_frames)), floor2(max_frames), total_frames ) )

    indices = unique( int(linspace(0, total_frames - 1, n)) )  (truncation, float64)
    timestamps = indices / video_fps
    pad to a multiple of ``frame_factor`` by repeating the last index and timestamp

    e.g. total 20 frames at 10 fps, fps 1, min 8, max 3600:  n_raw = 2 → n = 8
         linspace(0, 19, 8) = 0, 2.71, 5.43, 8.14, 10.86, 13.57, 16.29, 19 → 0 2 5 8 10 13 16 19

With ``num_frames`` set, n = round2(num_frames) capped by total_frames instead.  Deviation from
qwen-vl, which raises for a one-frame video: we take that frame and pad it to a pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class VideoSamplingParams:
    """The one video-sampling config. Defaults are MiMo-V2.5's processor_config (docs/model.md §1):
    fps 1.0, max_frames 3600, min_frames null there -> 8 (sglang's fallback). A field a checkpoint
    leaves out or null keeps its default here (sglang would fall back to fps 2 / max 256 instead;
    every checkpoint we serve sets both)."""

    fps: float = 1.0
    """Frames sampled per second of video."""
    min_frames: int = 8
    """Fewest frames sampled from a video."""
    max_frames: int = 3600
    """Most frames sampled from a video."""
    num_frames: int | None = None
    """A fixed frame count instead of fps-based sampling."""
    frame_factor: int = 2
    """Frames come in groups of this many: a positive multiple of the checkpoint's temporal_patch_size (checked when the engine is built)."""

    def __post_init__(self) -> None:
        if not self.fps > 0:
            raise ValueError(f"VideoSamplingParams.fps must be positive, got {self.fps}")
        if self.frame_factor < 1:
            raise ValueError(f"VideoSamplingParams.frame_factor must be >= 1, got {self.frame_factor}")
        if self.min_frames < 1 or self.max_frames < max(self.min_frames, self.frame_factor):
            raise ValueError(
                f"VideoSamplingParams needs 1 <= min_frames <= max_frames and max_frames >= "
                f"frame_factor, got {self.min_frames}, {self.max_frames}, {self.frame_factor}"
            )
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"VideoSamplingParams.num_frames must be >= 1, got {self.num_frames}")

    @classmethod
    def from_processor_config(cls, d: Mapping[str, Any]) -> "VideoSamplingParams":
        """From a checkpoint's ``processor_config`` (fps, min_frames, max_frames, num_frames,
        temporal_patch_size); absent or null fields keep the defaults. A min_frames above
        max_frames is lowered to it (a small checkpoint may cap max_frames below the default 8)."""

        def get(key: str, default: Any) -> Any:
            return default if d.get(key) is None else d[key]

        max_frames = int(get("max_frames", cls.max_frames))
        num_frames = get("num_frames", None)
        return cls(fps=float(get("fps", cls.fps)), min_frames=min(int(get("min_frames", cls.min_frames)), max_frames),
                   max_frames=max_frames, num_frames=None if num_frames is None else int(num_frames),
                   frame_factor=int(get("temporal_patch_size", cls.frame_factor)))


@dataclass(frozen=True)
class FrameSampling:
    """The sampled source frame indices (ascending, possibly with a repeated padded tail) and
    their timestamps in seconds."""

    indices: tuple[int, ...]
    timestamps: tuple[float, ...]

    @property
    def num_frames(self) -> int:
        return len(self.indices)


def _floor_to(x: float, factor: int) -> int:
    return int(math.floor(x / factor)) * factor


def _ceil_to(x: float, factor: int) -> int:
    return int(math.ceil(x / factor)) * factor


def smart_nframes(total_frames: int, video_fps: float, params: VideoSamplingParams) -> int:
    """Number of frames to sample before padding (a multiple of ``frame_factor``, at most
    ``total_frames``; 0 only when the video has fewer than ``frame_factor`` frames)."""
    if total_frames < 1:
        raise ValueError(f"video has no frames (total_frames={total_frames})")
    if not video_fps > 0:
        raise ValueError(f"video_fps must be positive, got {video_fps}")
    f = params.frame_factor
    if params.num_frames is not None:
        n = min(int(round(params.num_frames / f)) * f, _floor_to(total_frames, f))
        return max(n, f) if total_frames >= f else 0
    n_raw = total_frames / video_fps * params.fps
    lo = _ceil_to(params.min_frames, f)
    hi = _floor_to(params.max_frames, f)
    return _floor_to(min(max(n_raw, lo), hi, total_frames), f)


def sample_frames(total_frames: int, video_fps: float, params: VideoSamplingParams) -> FrameSampling:
    """Frame indices and timestamps for a video of ``total_frames`` at ``video_fps``."""
    n = smart_nframes(total_frames, video_fps, params)
    if n == 0:
        indices = list(range(total_frames))  # fewer frames than one temporal patch: take all
    else:
        indices = np.unique(np.linspace(0, total_frames - 1, n).astype(np.int64)).tolist()
    f = params.frame_factor
    indices += [indices[-1]] * ((-len(indices)) % f)
    return FrameSampling(tuple(int(i) for i in indices), tuple(i / video_fps for i in indices))
