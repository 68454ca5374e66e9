"""The banded conversions ``to_rgb8`` now uses for 16-bit, 32-bit and float images give the same
pixels as the whole-array ones did, and so do its conversions of images with alpha onto white (in
many bands of an odd number of rows, and in the default ones). Part of what keeps a decode within
what it reserves in the decode budget (test_decode_peaks.py)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mm_pipeline.media.decode import image as image_mod


# ---- the banded conversions give the same pixels ------------------------------------------------------
def _reference_gray(img: Image.Image) -> np.ndarray:
    """to_rgb8's 16-bit / 32-bit / float rules as whole-array numpy (before the bands)."""
    if img.mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        if arr.size and np.nanmin(arr) >= 0.0 and np.nanmax(arr) <= 1.0:
            arr = arr * 255.0
        gray = np.clip(np.nan_to_num(arr), 0, 255).round().astype(np.uint8)
    else:
        gray = (np.clip(np.asarray(img).astype(np.int64), 0, 65535) >> 8).astype(np.uint8)
    return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))


def _reference_on_white(rgba: np.ndarray) -> np.ndarray:
    rgb, a = rgba[:, :, :3].astype(np.uint32), rgba[:, :, 3:4].astype(np.uint32)
    return ((rgb * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


@pytest.mark.parametrize("band", [None, 100])
def test_banded_conversions_give_the_same_pixels(monkeypatch, band):
    if band is not None:  # many bands of an odd number of rows
        monkeypatch.setattr(image_mod, "_BAND_PIXELS", band, raising=False)
    rng = np.random.default_rng(0)
    h, w = 37, 53
    floats = rng.uniform(-20, 300, (h, w)).astype(np.float32)
    floats[3, 4], floats[5, 6], floats[7, 8] = np.nan, np.inf, -np.inf
    unit = rng.uniform(0, 1, (h, w)).astype(np.float32)
    unit[1, 1] = np.nan
    grays = [Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16)),
             Image.fromarray(rng.integers(-70000, 140000, (h, w), dtype=np.int32), "I"),
             Image.fromarray(floats, "F"), Image.fromarray(unit, "F")]
    for img in grays:
        np.testing.assert_array_equal(image_mod.to_rgb8(img), _reference_gray(img), err_msg=img.mode)
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    rgba[0, :, 3], rgba[1, :, 3] = 0, 255
    for mode in ("RGBA", "LA", "PA"):
        img = Image.fromarray(rgba, "RGBA") if mode == "RGBA" else Image.fromarray(rgba, "RGBA").convert(mode)
        want = _reference_on_white(np.asarray(img.convert("RGBA")))
        np.testing.assert_array_equal(image_mod.to_rgb8(img), want, err_msg=mode)
