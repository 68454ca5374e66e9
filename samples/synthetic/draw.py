"""Rasterise solid shapes onto a uniform gray canvas (numpy, RGB uint8).

Anti-aliasing by supersampling: each pixel's coverage is the fraction of ``ss x ss`` sub-pixel centres
inside the shape, and the pixel is ``gray * (1 - coverage) + colour * coverage``. Only the shape's
bounding box is supersampled, so the cost is ``side^2 * ss^2`` per shape, independent of image size.

Sub-pixel centres for ss = 2 inside pixel column j (pixel centres are at j + 0.5)::

    j        j+0.25   j+0.5   j+0.75     j+1
    |----------x---------------x----------|
"""

from __future__ import annotations

import numpy as np

from samples.synthetic.spec import COLOURS, ShapeSpec

DEFAULT_SUPERSAMPLE = 4


def coverage(shape: ShapeSpec, supersample: int = DEFAULT_SUPERSAMPLE) -> np.ndarray:
    """Fraction of each pixel of the ``side x side`` bounding box covered by the shape, float32 in [0, 1].

    Coordinates are local to the box: (0, 0) is its top-left corner, (side, side) its bottom-right.
    """
    if supersample < 1:
        raise ValueError(f"supersample must be >= 1, got {supersample}")
    s, ss = shape.side, supersample
    sub = (np.arange(s * ss, dtype=np.float64) + 0.5) / ss     # sub-pixel centres along one axis
    ys, xs = sub[:, None], sub[None, :]
    if shape.kind == "square":
        inside = np.ones((s * ss, s * ss), dtype=bool)
    elif shape.kind == "circle":
        r = s / 2.0
        inside = (xs - r) ** 2 + (ys - r) ** 2 <= r * r
    elif shape.kind == "triangle":
        # Apex at (s/2, 0), base from (0, s) to (s, s): at depth y the half-width is y / 2.
        inside = np.abs(xs - s / 2.0) <= ys / 2.0
    else:  # ShapeSpec validates kinds; this guards against a new kind added without a rasteriser
        raise ValueError(f"no rasteriser for shape kind {shape.kind!r}")
    return inside.reshape(s, ss, s, ss).mean(axis=(1, 3), dtype=np.float32)


def paint(canvas: np.ndarray, shape: ShapeSpec, colour: str | None = None,
          supersample: int = DEFAULT_SUPERSAMPLE) -> None:
    """Blend ``shape`` into ``canvas`` (H x W x 3 uint8) in place, in ``colour`` (default: its own)."""
    h, w = canvas.shape[:2]
    if shape.x < 0 or shape.y < 0 or shape.x + shape.side > w or shape.y + shape.side > h:
        raise ValueError(f"shape box ({shape.x}, {shape.y}, side {shape.side}) is outside the {w}x{h} canvas")
    rgb = np.asarray(COLOURS[colour or shape.colour], dtype=np.float32)
    cov = coverage(shape, supersample)[:, :, None]
    region = canvas[shape.y:shape.y + shape.side, shape.x:shape.x + shape.side].astype(np.float32)
    canvas[shape.y:shape.y + shape.side, shape.x:shape.x + shape.side] = np.rint(
        region * (1.0 - cov) + rgb * cov).astype(np.uint8)


def render(width: int, height: int, gray: int, shapes: tuple[ShapeSpec, ...],
           supersample: int = DEFAULT_SUPERSAMPLE) -> np.ndarray:
    """A ``height x width x 3`` uint8 RGB image: uniform ``gray`` with ``shapes`` painted on it."""
    canvas = np.full((height, width, 3), gray, dtype=np.uint8)
    for shape in shapes:
        paint(canvas, shape, supersample=supersample)
    return canvas
