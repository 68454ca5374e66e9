"""Still images (and animated GIF/WebP frames) → uint8 RGB with PIL.

Normalisation rules, so the encoder always sees what a viewer would show:

    EXIF orientation           applied (phone photos are stored sideways)
    alpha (RGBA, LA, PA, P+t)  composited on white (the model card's rule: transparent = white)
    1, L, P, CMYK, YCbCr, LAB  converted to RGB by PIL
    16-bit gray (I;16*, I)     high byte (v >> 8), like PIL's own 16-bit RGB loader
    float (F)                  [0, 1] scaled to [0, 255]; otherwise clipped to [0, 255]
    animated                   first frame (all frames only when sent as a video)

The pixel limit is checked on the header, before the pixel data is decoded.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from mm_pipeline.errors import MediaTooLarge, UndecodableMediaError
from mm_pipeline.media.ingest import MediaLimits
from mm_pipeline.media.types import DecodedImage, MediaItem

_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


def decode_image(item: MediaItem, limits: MediaLimits = MediaLimits()) -> DecodedImage:
    """Decode ``item`` (any PIL-readable image; the first frame of an animation)."""
    with _open(item.data, item.origin, limits) as img:
        try:
            return DecodedImage(torch.from_numpy(to_rgb8(img)), item.format)
        except _DECODE_ERRORS as exc:
            raise UndecodableMediaError(f"{item.format} image from {item.origin} is damaged ({exc})") from exc


def to_rgb8(img: Image.Image) -> np.ndarray:
    """The current frame of ``img`` as [H, W, 3] uint8 RGB following the rules above."""
    img = ImageOps.exif_transpose(img) or img
    mode = img.mode
    if mode.startswith("I;16") or mode == "I":
        arr = np.asarray(img).astype(np.int64)
        gray = (np.clip(arr, 0, 65535) >> 8).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))
    if mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        if arr.size and np.nanmin(arr) >= 0.0 and np.nanmax(arr) <= 1.0:
            arr = arr * 255.0
        gray = np.clip(np.nan_to_num(arr), 0, 255).round().astype(np.uint8)
        return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))
    if mode == "P":
        mode = "RGBA" if "transparency" in img.info else "RGB"
        img = img.convert(mode)
    if mode in _ALPHA_MODES:
        return _on_white(np.asarray(img.convert("RGBA")))
    if mode != "RGB":
        img = img.convert("RGB")
    return np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy shares it


def _on_white(rgba: np.ndarray) -> np.ndarray:
    # out = rgb·a + 255·(1 − a), in integers with rounding: (rgb·a + 255·(255 − a) + 127) // 255
    rgb = rgba[:, :, :3].astype(np.uint32)
    a = rgba[:, :, 3:4].astype(np.uint32)
    return ((rgb * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


@dataclass(frozen=True)
class AnimationInfo:
    width: int
    height: int
    durations_s: tuple[float, ...]  # display time of each frame

    @property
    def num_frames(self) -> int:
        return len(self.durations_s)

    @property
    def fps(self) -> float:
        total = sum(self.durations_s)
        return self.num_frames / total if total > 0 else 10.0  # no timing: browsers' 100 ms


def probe_animation(item: MediaItem, limits: MediaLimits = MediaLimits()) -> AnimationInfo:
    """Frame count and timing of a GIF/WebP (a still image is a one-frame animation)."""
    with _open(item.data, item.origin, limits) as img:
        n = getattr(img, "n_frames", 1)
        if n > limits.max_frames:
            raise MediaTooLarge(f"animation has {n} frames, limit {limits.max_frames}")
        durations = []
        try:
            for k in range(n):
                img.seek(k)
                if img.format == "WEBP":
                    img.load()  # PIL's WebP reader fills info["duration"] only when a frame loads
                durations.append(max(0.0, float(img.info.get("duration") or 0)) / 1000.0)
        except _DECODE_ERRORS as exc:
            raise UndecodableMediaError(f"animation from {item.origin} is damaged ({exc})") from exc
        if sum(durations) > limits.max_duration_s:
            raise MediaTooLarge(f"animation lasts {sum(durations):.1f} s, limit {limits.max_duration_s}")
        return AnimationInfo(img.width, img.height, tuple(durations))


def decode_animation_frames(item: MediaItem, indices: Sequence[int],
                            limits: MediaLimits = MediaLimits()) -> torch.Tensor:
    """Frames ``indices`` (ascending, repeats allowed) of an animation as [T, H, W, 3] uint8."""
    with _open(item.data, item.origin, limits) as img:
        out: list[np.ndarray] = []
        try:
            for k in indices:
                if not out or k != indices[len(out) - 1]:
                    img.seek(k)  # PIL composes GIF/WebP frames (disposal, blending) on seek
                    frame = to_rgb8(img.convert("RGBA"))
                out.append(frame)
        except _DECODE_ERRORS as exc:
            raise UndecodableMediaError(f"animation from {item.origin} is damaged ({exc})") from exc
    return torch.from_numpy(np.stack(out)) if out else torch.empty(0, img.height, img.width, 3,
                                                                     dtype=torch.uint8)


def _open(data: bytes, origin: str, limits: MediaLimits) -> Image.Image:
    """Open lazily (header only) and enforce the pixel limit before any pixel is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our limit decides
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise MediaTooLarge(f"image from {origin} is too large ({exc})") from exc
    except _DECODE_ERRORS as exc:
        raise UndecodableMediaError(f"image from {origin} cannot be read ({exc})") from exc
    w, h = img.size
    if w * h > limits.max_pixels:
        img.close()
        raise MediaTooLarge(f"image is {w}x{h} = {w * h} pixels, limit {limits.max_pixels}")
    if w == 0 or h == 0:
        img.close()
        raise UndecodableMediaError(f"image from {origin} has no pixels ({w}x{h})")
    return img
