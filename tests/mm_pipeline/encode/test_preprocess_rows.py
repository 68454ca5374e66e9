"""Preprocessing of frames already at their size: patchified as uint8, normalised as rows -- the
same bits as normalising float frames first (the path resized images still take)."""

from __future__ import annotations

import pytest
import torch

from encoders.image_processing import ImageProcessingConfig, normalize, patchify, resize_frames
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.media.types import DecodedImage


@pytest.mark.parametrize("t,h,w", [(2, 64, 96), (4, 32, 160), (1, 96, 64)])
def test_uint8_patchify_path_equals_float_pipeline(t, h, w):
    """Frames already at their size: patchify as uint8 and normalise rows == normalise then patchify."""
    g = torch.Generator().manual_seed(t + h)
    frames = torch.randint(0, 256, (t, h, w, 3), dtype=torch.uint8, generator=g)
    pre = Preprocessor(ImageProcessingConfig(min_pixels=32 * 32, max_pixels=h * w))
    want, grid = patchify(normalize(frames.permute(0, 3, 1, 2).float()))
    if t % 2 == 0:
        got = torch.cat([u.rows for u in pre.video_groups(frames, (h, w))])
    else:
        got = pre.image(DecodedImage(frames[0], "png"), size=(h, w)).rows
    assert torch.equal(got, want) and got.is_contiguous()


def test_resized_image_keeps_the_float_pipeline():
    frames = torch.randint(0, 256, (1, 50, 70, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    pre = Preprocessor(ImageProcessingConfig(min_pixels=32 * 32, max_pixels=96 * 96))
    got = pre.image(DecodedImage(frames[0], "png"), size=(64, 96))
    want, grid = patchify(normalize(resize_frames(frames.permute(0, 3, 1, 2).float(), 64, 96)))
    assert torch.equal(got.rows, want) and got.grid == grid
