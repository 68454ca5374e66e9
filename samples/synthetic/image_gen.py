"""Write an ``ImageSpec`` as a PNG, JPEG or WebP file (PIL)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from samples.synthetic.draw import render
from samples.synthetic.spec import ImageSpec

# PIL format names and save options per spec format. JPEG: quality >= 85 (checked by ImageSpec);
# WebP lossy at the same quality so its colours survive like JPEG's.
_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def render_image(spec: ImageSpec) -> np.ndarray:
    """The exact pixels (H x W x 3 uint8 RGB) before any lossy coding."""
    return render(spec.width, spec.height, spec.gray, spec.shapes)


def write_image(spec: ImageSpec, path: str | Path) -> Path:
    """Render ``spec`` and save it to ``path`` in ``spec.format``; returns the path."""
    path = Path(path)
    img = Image.fromarray(render_image(spec))
    options: dict[str, object] = {}
    if spec.format in ("jpeg", "webp"):
        options["quality"] = spec.quality
    if spec.format == "png":
        options["optimize"] = True
    img.save(path, format=_PIL_FORMAT[spec.format], **options)
    return path
