r"""Which source frames each streaming chunk of a video decodes.

A chunk is a run of consecutive frame groups (``tp`` sampled frames each). It is decoded by its own
decoder that seeks to the last keyframe at or before its first frame, so chunks decode in parallel
and the first groups reach the encoder while later ones still decode:

    sampled    s0 s1 | s2 s3 | s4 s5 | s6 s7        groups of tp = 2 frames
    keyframes  K        K        K        K
    chunks     [g0 g1]         [g2 g3]              groups_per_chunk = 2

A chunk whose seek point lies inside the previous chunk decodes those frames a second time. That
is accepted while the overlap is smaller than the chunk's own frames (less than doubles its cost);
otherwise the chunk is merged into the previous one (a video with one keyframe becomes one chunk):

    prev chunk  [seekA ........ lastA]
    next chunk          [seekB ...|.. firstB ....... lastB]
                         \overlap/  \___ own frames ___/      split iff overlap < own
"""

from __future__ import annotations

from typing import Sequence

import torch

from mm_pipeline.media.decode.budget import DecodeControl
from mm_pipeline.media.decode.image import decode_animation_frames
from mm_pipeline.media.decode.video import VideoInfo, decode_range
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem


def plan_chunks(groups: Sequence[int], indices: Sequence[int], keyframes: Sequence[int], tp: int,
                groups_per_chunk: int) -> list[list[int]]:
    """Cut ascending group numbers into chunks (see module doc). ``indices[g*tp + j]`` is the
    source frame of sampled frame j of group g."""
    if groups_per_chunk < 1:
        raise ValueError(f"groups_per_chunk must be >= 1, got {groups_per_chunk}")
    num_groups = len(indices) // tp
    chunks: list[list[int]] = []
    for g in groups:
        prev = chunks[-1] if chunks else None
        if prev is not None and g == prev[-1] + 1:
            first = indices[g * tp]
            seek = max((k for k in keyframes if k <= first), default=0)
            overlap = indices[prev[-1] * tp + tp - 1] - seek + 1
            own = indices[min(g + groups_per_chunk, num_groups) * tp - 1] - first + 1
            if len(prev) < groups_per_chunk or overlap >= own:
                prev.append(g)
                continue
        chunks.append([g])
    return chunks


def decode_chunk(item: MediaItem, info: VideoInfo | None, indices: Sequence[int], groups: Sequence[int], tp: int,
                 limits: MediaLimits, size: tuple[int, int] | None = None,
                 control: DecodeControl | None = None, threads: int = 1) -> torch.Tensor:
    """Frames [len(groups) * tp, H, W, 3] uint8 of ``groups`` in order (``info`` None: a GIF/WebP
    animation, decoded with PIL), scaled to ``size`` (h, w) as they are decoded; ``threads``: the
    codec's own threads per decoder (decode_range)."""
    wanted = [indices[g * tp + j] for g in groups for j in range(tp)]
    targets = sorted(set(wanted))  # a padded tail repeats its last frame
    if info is None:
        frames = decode_animation_frames(item, targets, limits, size, control)
    else:
        frames = decode_range(item, info, targets, size=size, control=control, threads=threads)
    if wanted == targets:
        return frames  # no padded tail: the rows are in order already (saves a copy of the chunk)
    row = {t: k for k, t in enumerate(targets)}
    return frames[[row[t] for t in wanted]]
