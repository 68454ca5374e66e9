"""Still images (and animated GIF/WebP frames) → uint8 RGB with PIL.

Normalisation rules, so the encoder always sees what a viewer would show:

    EXIF orientation           applied (phone photos are stored sideways)
    alpha (RGBA, LA, PA, P+t)  composited on white (the model card's rule: transparent = white)
    1, L, P, CMYK, YCbCr, LAB  converted to RGB by PIL
    16-bit gray (I;16*, I)     high byte (v >> 8), like PIL's own 16-bit RGB loader
    float (F)                  [0, 1] scaled to [0, 255]; otherwise clipped to [0, 255]
    animated                   first frame (all frames only when sent as a video)

The pixel limit is checked on the header, before the pixel data is decoded. Given a ``target``
size rule, a large image is shrunk while still uint8 (JPEG: DCT scaling during decode via
``draft``; others: an integer box ``reduce``) to at most twice the target per side, so the float
copy the preprocessor makes stays near the target size (README "Limits and security").
"""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from mm_pipeline.errors import MediaTooLarge, UndecodableMediaError
from mm_pipeline.media.decode.budget import DecodeControl, check
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import DecodedImage, MediaItem

_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
# What PIL's format parsers raise on malformed input (found by tests/mm_pipeline/media/test_fuzz_media.py:
# a truncated GIF extension is an IndexError or a struct.error, not an OSError)
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError, IndexError, KeyError,
                  struct.error, ZeroDivisionError)


TargetSize = Callable[[int, int], "tuple[int, int]"]  # (h, w) -> the size the encoder resizes to


def decode_image(item: MediaItem, limits: MediaLimits = MediaLimits(), target: TargetSize | None = None
                 ) -> DecodedImage:
    """Decode ``item`` (any PIL-readable image; the first frame of an animation); with ``target``,
    shrunk in uint8 to at most twice ``target(h, w)`` per side (see module doc)."""
    with _open(item.data, item.origin, limits) as img:
        try:
            if target is not None:
                img = _shrunk(img, target)
            return DecodedImage(torch.from_numpy(to_rgb8(img)), item.format)
        except _DECODE_ERRORS as exc:
            raise UndecodableMediaError(f"{item.format} image from {item.origin} is damaged ({exc})") from exc


def probe_image(item: MediaItem, limits: MediaLimits = MediaLimits()) -> tuple[int, int]:
    """(h, w) of ``item`` as shown (EXIF orientation applied), from the header; limits enforced."""
    with _open(item.data, item.origin, limits) as img:
        return image_size(img)


def image_decode_bytes(h: int, w: int) -> int:
    """Decoded bytes of an (h, w) image as a request's decoded-bytes budget counts them (the
    RGBA decode plus one RGB copy) -- not the peak a decode holds: ``decode_image_peak``."""
    return 7 * h * w


def decode_image_peak(h: int, w: int, target: tuple[int, int]) -> tuple[int, int]:
    """(peak bytes, decoded pixels at most) of ``decode_image`` for an (h, w) image (its header's
    size, as shown) given the size ``target`` it will be resized to -- what the decode budget
    reserves for it. Every PIL image holds 4 B/px but for 1, L, P (1) and I;16 (2); per stage:

        load            the image (4 B/px); a progressive JPEG's coefficients (up to 8 B/px)
        shrink (_shrunk, a source over twice the target per side): the source and a converted
                        copy (4 + 4 B/px), the reduced image and its oriented copy (4 + 4 B per
                        reduced pixel); to_rgb8 then runs on the reduced image beside the source
        to_rgb8         see ``_to_rgb8_bytes``
    """
    s = h * w
    factor = min(w // max(target[1], 1), h // max(target[0], 1))  # _shrunk's, from the header
    if factor < 2:
        return 4 * s + max(8 * s, _to_rgb8_bytes(s, w, oriented=True)), s
    # reduced by the factor, or (a JPEG's DCT scaling: a power of two) by at least 2 per side
    d = -(-h // 2) * -(-w // 2)
    shrink = 4 * s + 4 * s + 4 * d + 4 * d
    return max(4 * s + 8 * s, shrink, 4 * s + 4 * d + _to_rgb8_bytes(d, -(-w // 2), oriented=False)), d


def _to_rgb8_bytes(pixels: int, width: int, oriented: bool) -> int:
    """Bytes ``to_rgb8`` holds beside the image it is given, of ``pixels`` pixels:

        oriented        the EXIF-transposed copy (4 B/px)
        then either     a converted copy (4 B/px) and ``tobytes``' chunks and their join (4 + 4)
        or              the array of those bytes (4), the output (gray 1 + RGB 3, or RGB 3) and
                        one band's temporaries (_on_white, _gray8: at most 24 B per band pixel)
    """
    band = min(pixels, max(_BAND_PIXELS, width))
    oriented_copy = 4 * pixels if oriented else 0
    return oriented_copy + max(4 * pixels + 8 * pixels, 4 * pixels + 4 * pixels + 24 * band)


def image_size(img: Image.Image) -> tuple[int, int]:
    """(h, w) as shown, EXIF orientation applied -- from the header, nothing decoded."""
    w, h = img.size
    return (w, h) if _orientation(img) in _SWAPS_AXES else (h, w)


_SWAPS_AXES = {5, 6, 7, 8}
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270,
              7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}  # what ImageOps.exif_transpose does


def _orientation(img: Image.Image) -> int:
    # PIL's PNG getexif() decodes the whole image to look for an eXIf chunk after the pixel data:
    # a PNG is oriented by the chunks before its pixels only, so a header probe stays a probe
    if img.format == "PNG" and "exif" not in img.info:
        return 1
    try:
        return int(img.getexif().get(0x0112, 1))
    except (ValueError, TypeError, OSError, SyntaxError):
        return 1


def _shrunk(img: Image.Image, target: TargetSize) -> Image.Image:
    """``img`` reduced by the largest integer factor that keeps it >= the target, oriented."""
    h, w = image_size(img)
    th, tw = target(h, w)
    factor = min(w // max(tw, 1), h // max(th, 1))
    if factor < 2:
        return img
    orientation = _orientation(img)
    if img.format == "JPEG":
        img.draft("RGB" if img.mode not in ("L", "CMYK") else img.mode,
                  (img.width // factor, img.height // factor))  # DCT scaling: decodes at 1/2..1/8
    if img.mode.startswith("I;16"):
        img = img.convert("I")  # same values; to_rgb8 keeps the high byte
    elif img.mode == "P" or img.mode not in ("1", "L", "LA", "RGB", "RGBA", "CMYK", "YCbCr", "I", "F"):
        img = img.convert("RGBA" if img.mode == "P" and "transparency" in img.info else "RGB")
    th_raw, tw_raw = (tw, th) if orientation in _SWAPS_AXES else (th, tw)  # target in stored axes
    factor = min(img.width // max(tw_raw, 1), img.height // max(th_raw, 1))
    if factor >= 2:
        try:
            small = img.reduce(factor)
        except ValueError:  # a mode reduce does not take
            small = img.convert("RGBA" if img.mode in _ALPHA_MODES else "RGB").reduce(factor)
    else:
        small = img.copy()
    method = _TRANSPOSE.get(orientation)
    small = small.transpose(method) if method is not None else small
    small.info = {}  # oriented already: to_rgb8 must not apply the EXIF/XMP orientation again
    return small


def to_rgb8(img: Image.Image) -> np.ndarray:
    """The current frame of ``img`` as [H, W, 3] uint8 RGB following the rules above."""
    method = _TRANSPOSE.get(_orientation(img))  # the rule image_size plans with
    img = img.transpose(method) if method is not None else img
    mode = img.mode
    if mode.startswith("I;16") or mode == "I":
        return _gray8(np.asarray(img), lambda v: (np.clip(v.astype(np.int64), 0, 65535) >> 8).astype(np.uint8))
    if mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        scale = 255.0 if arr.size and np.nanmin(arr) >= 0.0 and np.nanmax(arr) <= 1.0 else 1.0
        return _gray8(arr, lambda v: np.clip(np.nan_to_num(v * scale if scale != 1.0 else v), 0, 255)
                      .round().astype(np.uint8))
    if mode == "P":
        mode = "RGBA" if "transparency" in img.info else "RGB"
        img = img.convert(mode)
    if mode in _ALPHA_MODES:
        # (converting to its own mode would copy the image once more for nothing)
        return _on_white(np.asarray(img if mode == "RGBA" else img.convert("RGBA")))
    if mode != "RGB":
        img = img.convert("RGB")
    return np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy shares it


# Pixels per band of the banded conversions below: their temporaries (at most 24 B per band
# pixel) stay a few MiB whatever the image (decode_image_peak counts one band)
_BAND_PIXELS = 1 << 18


def _band_rows(width: int) -> int:
    return max(1, _BAND_PIXELS // max(1, width))


def _on_white(rgba: np.ndarray) -> np.ndarray:
    # out = rgb·a + 255·(1 − a), in integers with rounding: (rgb·a + 255·(255 − a) + 127) // 255;
    # in bands of rows, in place, so the uint32 temporaries stay small for a huge canvas
    out = np.empty(rgba.shape[:2] + (3,), dtype=np.uint8)
    step = _band_rows(rgba.shape[1])
    for r in range(0, rgba.shape[0], step):
        rgb = rgba[r:r + step, :, :3].astype(np.uint32)
        a = rgba[r:r + step, :, 3:4].astype(np.uint32)
        rgb *= a
        rgb += 255 * (255 - a) + 127
        rgb //= 255
        out[r:r + step] = rgb
    return out


def _gray8(arr: np.ndarray, to_uint8: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """[H, W, 3] uint8 of a one-band array, ``to_uint8`` applied band by band (elementwise, so
    the same values as on the whole array, without full-size int64 / float temporaries)."""
    gray = np.empty(arr.shape, dtype=np.uint8)
    step = _band_rows(arr.shape[1])
    for r in range(0, arr.shape[0], step):
        gray[r:r + step] = to_uint8(arr[r:r + step])
    return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))


@dataclass(frozen=True)
class AnimationInfo:
    # the largest canvas the frames make: a GIF frame may reach past the logical screen its header
    # declares, and PIL then grows the canvas there for the frames after it (as browsers show it)
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


def probe_animation(item: MediaItem, limits: MediaLimits = MediaLimits(),
                    control: DecodeControl | None = None) -> AnimationInfo:
    """Frame count and timing of a GIF/WebP (a still image is a one-frame animation).

    PIL composites every frame onto the full canvas as it seeks, so the work of walking an
    animation is canvas pixels x frames, whatever the size of the frames themselves (300 one-pixel
    frames on a 4096² canvas composite 5 G pixels): bounded by ``max_animation_pixels`` from the
    header, before any frame is walked."""
    with _open(item.data, item.origin, limits) as img:
        try:
            n = getattr(img, "n_frames", 1)  # GIF: a walk over the frame headers
        except _DECODE_ERRORS as exc:
            raise UndecodableMediaError(f"animation from {item.origin} is damaged ({exc})") from exc
        if n > limits.max_frames:
            raise MediaTooLarge(f"animation has {n} frames, limit {limits.max_frames}")
        work = img.width * img.height * n
        if work > limits.max_animation_pixels:
            raise MediaTooLarge(f"animation of {n} frames on a {img.width}x{img.height} canvas composites "
                                f"{work} pixels, limit {limits.max_animation_pixels} (max_animation_pixels)")
        durations = []
        walked = 0  # canvas pixels composited so far (the canvas may grow, see _check_canvas)
        width, height = img.width, img.height  # the largest canvas so far
        try:
            for k in range(n):
                check(control)
                img.seek(k)
                _check_canvas(img, limits)
                width, height = max(width, img.width), max(height, img.height)
                walked += img.width * img.height
                if walked > limits.max_animation_pixels:
                    raise MediaTooLarge(f"animation frames grow the canvas to {img.width}x{img.height}; "
                                        f"compositing them exceeds max_animation_pixels ({limits.max_animation_pixels})")
                if img.format == "WEBP":
                    img.load()  # PIL's WebP reader fills info["duration"] only when a frame loads
                durations.append(max(0.0, float(img.info.get("duration") or 0)) / 1000.0)
        except _DECODE_ERRORS as exc:
            raise UndecodableMediaError(f"animation from {item.origin} is damaged ({exc})") from exc
        if sum(durations) > limits.max_duration_s:
            raise MediaTooLarge(f"animation lasts {sum(durations):.1f} s, limit {limits.max_duration_s}")
        return AnimationInfo(width, height, tuple(durations))


# Peak bytes per canvas pixel of decode_animation_frames (peak RSS of a fresh process, 1500² and
# 3000² canvases): GIF 13.0 -- PIL composites each frame onto the RGB(A) canvas (4) from the
# frame decoded as P over the whole canvas (1), converted (4) and cropped (4) --, WebP 24 (libwebp's
# animation decoder keeps two RGBA canvases; PIL copies the frame's bytes into its image and makes
# the RGBA copy). Each frame is resized to the encoder's size as soon as it is composited.
_ANIMATION_BYTES_PER_PIXEL = {"gif": 14, "webp": 25}


def animation_decode_bytes(fmt: str, height: int, width: int) -> int:
    """Peak bytes ``decode_animation_frames`` holds for a ``fmt`` animation whose largest canvas
    is ``height`` x ``width`` (``AnimationInfo``: grown past its header where frames reach past it)."""
    return _ANIMATION_BYTES_PER_PIXEL.get(fmt, max(_ANIMATION_BYTES_PER_PIXEL.values())) * height * width


def decode_animation_frames(item: MediaItem, indices: Sequence[int], limits: MediaLimits = MediaLimits(),
                            size: tuple[int, int] | None = None, control: DecodeControl | None = None
                            ) -> torch.Tensor:
    """Frames ``indices`` (ascending, repeats allowed) of an animation as [T, H, W, 3] uint8, in
    one forward pass (PIL composites each frame once as it seeks forward); with ``size`` (h, w)
    each frame is resized in uint8 as soon as it is composited."""
    if any(b < a for a, b in zip(indices, indices[1:])):
        raise ValueError("decode_animation_frames wants ascending indices (one forward pass)")
    with _open(item.data, item.origin, limits) as img:
        out: list[np.ndarray] = []
        try:
            for k in indices:
                if not out or k != indices[len(out) - 1]:
                    check(control)
                    img.seek(k)  # PIL composes GIF/WebP frames (disposal, blending) on seek
                    _check_canvas(img, limits)
                    rgba = img.convert("RGBA")
                    if size is not None and rgba.size != (size[1], size[0]):
                        rgba = rgba.resize((size[1], size[0]), Image.Resampling.BILINEAR)
                    frame = to_rgb8(rgba)
                out.append(frame)
        except _DECODE_ERRORS as exc:
            raise UndecodableMediaError(f"animation from {item.origin} is damaged ({exc})") from exc
        h, w = size or (img.height, img.width)
    return torch.from_numpy(np.stack(out)) if out else torch.empty(0, h, w, 3, dtype=torch.uint8)


def _check_canvas(img: Image.Image, limits: MediaLimits) -> None:
    # a GIF frame may reach past the logical screen: PIL then grows the canvas mid-animation, so
    # the header's size does not bound the frames (found by the fuzz target)
    if img.width * img.height > limits.max_pixels:
        raise MediaTooLarge(f"animation frame grows the canvas to {img.width}x{img.height} = "
                            f"{img.width * img.height} pixels, limit {limits.max_pixels}")


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
