"""Pixel preprocessing for the vision tower, as pure torch functions (run on the encoder's device).

    frames [T, C, H, W] (0-255) --smart_resize + bilinear--> [T, C, H', W'] --normalise-->
        --patchify--> rows [t*gh*gw, C*2*16*16], grid_thw (t, gh, gw)

Row order of :func:`patchify` (docs/model.md §3): frames outermost, then merge units row-major, then
the m x m patches of a unit row-major; a row lists (C, temporal, kh, kw) -- the Conv3d weight order.

    frame 8x8 patches, merge 2 ->  rows  0..3 = unit (0,0) patches (0,0) (0,1) (1,0) (1,1)
                                   rows  4..7 = unit (0,1) patches (0,2) (0,3) (1,2) (1,3) ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


class AspectRatioError(ValueError):
    """An image or video frame longer than ``MAX_ASPECT_RATIO`` times its width (or the reverse).

    A property of the input, not a bug: its own type so a server can answer it as the client's
    error (mm_pipeline/encode/preprocess.py maps it to a media error) without reading messages,
    and a ``ValueError`` as before for everyone else."""


@dataclass(frozen=True)
class ImageProcessingConfig:
    """Processor geometry (hub ``processor_config`` names in :meth:`from_dict`)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 8192
    max_pixels: int = 8388608
    video_min_pixels: int = 8192
    video_max_pixels: int = 8388608
    video_total_max_pixels: int = 268435456
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this (one merge unit in pixels)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageProcessingConfig":
        return cls(
            patch_size=int(d.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(d.get("merge_size", cls.merge_size)),
            min_pixels=int(d.get("image_min_pixels", cls.min_pixels)),
            max_pixels=int(d.get("image_max_pixels", cls.max_pixels)),
            video_min_pixels=int(d.get("video_min_pixels", cls.video_min_pixels)),
            video_max_pixels=int(d.get("video_max_pixels", cls.video_max_pixels)),
            video_total_max_pixels=int(d.get("video_total_max_pixels", cls.video_total_max_pixels)),
        )

    def video_frame_max_pixels(self, num_frames: int) -> int:
        """Per-frame budget of a video: max(min, min(video_max, total_max * 2 // frames))."""
        if num_frames <= 0:
            raise ValueError(f"a video needs at least one frame, got {num_frames}")
        return max(self.video_min_pixels, min(self.video_max_pixels, self.video_total_max_pixels * 2 // num_frames))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels] where
    possible, aspect ratio kept as well as rounding allows.

    Errors (``ValueError``): non-positive sizes, min_pixels > max_pixels; ``AspectRatioError`` for an
    aspect ratio above 200.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if factor <= 0:
        raise ValueError(f"resize factor must be positive, got {factor}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels {min_pixels} > max_pixels {max_pixels}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise AspectRatioError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
                               f"{max(height, width) / min(height, width):.1f} ({height}x{width})")
    if min(height, width) < factor:
        # Too thin for one merge unit: scale up so the short side is one unit.
        scale = factor / min(height, width)
        height, width = max(factor, round(height * scale)), max(factor, round(width * scale))
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bilinear resize (align_corners=False, no antialias) of float frames [T, C, H, W]."""
    if frames.dim() != 4:
        raise ValueError(f"frames must be [T, C, H, W], got shape {tuple(frames.shape)}")
    frames = frames.float()
    if frames.shape[-2:] == (height, width):
        return frames
    return F.interpolate(frames, size=(height, width), mode="bilinear", align_corners=False)


def normalize(frames: torch.Tensor, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    """0-255 frames [T, C, H, W] -> (x/255 - mean) / std per channel."""
    if frames.shape[-3] != len(mean):
        raise ValueError(f"frames have {frames.shape[-3]} channels, mean/std have {len(mean)}")
    m = torch.tensor(mean, dtype=torch.float32, device=frames.device).view(-1, 1, 1) * 255.0
    s = torch.tensor(std, dtype=torch.float32, device=frames.device).view(-1, 1, 1) * 255.0
    return (frames.float() - m) / s


def normalize_rows(rows: torch.Tensor, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    """:func:`normalize` applied after :func:`patchify`: float rows [N, C*tp*p*p] of 0-255 values,
    normalised in place (channel outermost in a row) and returned. Same float32 arithmetic as
    ``patchify(normalize(frames))``, so the same bits; it lets the pixels be reordered while they
    are still uint8 (a quarter of the bytes) and needs no full-frame float temporaries."""
    if rows.dim() != 2 or rows.shape[-1] % len(mean):
        raise ValueError(f"rows must be [N, C*tp*p*p] with C = {len(mean)}, got shape {tuple(rows.shape)}")
    per = rows.shape[-1] // len(mean)
    m = (torch.tensor(mean, dtype=torch.float32, device=rows.device) * 255.0).repeat_interleave(per)
    s = (torch.tensor(std, dtype=torch.float32, device=rows.device) * 255.0).repeat_interleave(per)
    return rows.sub_(m).div_(s)


def patchify(frames: torch.Tensor, patch_size: int = 16, temporal_patch_size: int = 2,
             merge_size: int = 2) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames [T, C, H, W] -> (rows [t*gh*gw, C*tp*p*p], grid_thw). An odd frame count is padded by
    repeating the last frame (so an image is duplicated in time); H, W must be multiples of
    patch_size * merge_size."""
    if frames.dim() != 4:
        raise ValueError(f"frames must be [T, C, H, W], got shape {tuple(frames.shape)}")
    num, c, h, w = frames.shape
    factor = patch_size * merge_size
    if h % factor or w % factor:
        raise ValueError(f"frame size {h}x{w} is not a multiple of patch_size*merge_size = {factor}; "
                         f"resize with smart_resize first")
    if num == 0:
        raise ValueError("patchify needs at least one frame")
    if num % temporal_patch_size:
        pad = temporal_patch_size - num % temporal_patch_size
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, gh, gw = frames.shape[0] // temporal_patch_size, h // patch_size, w // patch_size
    m, p, tp = merge_size, patch_size, temporal_patch_size
    x = frames.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
    # axes: 0 t, 1 tp, 2 c, 3 hb, 4 hi, 5 kh, 6 wb, 7 wi, 8 kw -> (t, hb, wb, hi, wi, c, tp, kh, kw)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, c * tp * p * p), (t, gh, gw)


def preprocess_frames(frames: torch.Tensor, config: ImageProcessingConfig, *, max_pixels: int | None = None,
                      min_pixels: int | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """0-255 frames [T, C, H, W] (an image: T = 1) -> normalised patch rows and grid_thw."""
    if frames.dim() != 4:
        raise ValueError(f"frames must be [T, C, H, W], got shape {tuple(frames.shape)}")
    h, w = smart_resize(frames.shape[-2], frames.shape[-1], config.factor,
                        config.min_pixels if min_pixels is None else min_pixels,
                        config.max_pixels if max_pixels is None else max_pixels)
    x = normalize(resize_frames(frames, h, w), config.mean, config.std)
    return patchify(x, config.patch_size, config.temporal_patch_size, config.merge_size)


def preprocess_image(image: torch.Tensor, config: ImageProcessingConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One RGB image [C, H, W] (uint8 or float 0-255) -> (rows, grid_thw with t = 1)."""
    if image.dim() != 3:
        raise ValueError(f"an image must be [C, H, W], got shape {tuple(image.shape)}")
    return preprocess_frames(image[None], config)
