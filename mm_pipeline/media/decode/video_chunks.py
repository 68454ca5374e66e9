r"""Which source frames each streaming chunk of a video decodes.

A chunk is a run of consecutive frame groups (``tp`` sampled frames each). It is decoded by its own
decoder that seeks to the last keyframe at or before its first frame, so chunks decode in parallel
and the first groups reach the encoder while later ones still decode:

    sampled    s0 s1 | s2 s3 | s4 s5 | s6 s7        groups of tp = 2 frames
    keyframes  K        K        K        K
    chunks     [g0 g1]         [g2 g3]              groups_per_chunk = 2

A chunk whose seek point lies inside the previous chunk decodes those frames a second time. When
the decoder hands each group on as soon as it is decoded (``decode_chunk``'s ``on_group``; the
thread backend), a chunk need not be small to keep the encoder fed, so a group whose seek point
lies inside the previous chunk joins it -- no frame is decoded twice -- until that chunk holds
1 / ``min_chunks`` of the groups (so the decode workers still share the work). At 2 sampled
frames a second from a 30 fps video with a keyframe every 2 s, one-group chunks re-decoded every
GOP's first 16 frames: a 20 s 720p clip's 12 chunks decoded 582 frames, its 5 chunks now 516.
Otherwise (``min_chunks`` 0: a chunk's groups leave only when it is done) a chunk re-decodes the
overlap while it is smaller than its own frames (less than doubles its cost), and joins the
previous chunk beyond that (a video with one keyframe becomes one chunk):

    prev chunk  [seekA ........ lastA]
    next chunk          [seekB ...|.. firstB ....... lastB]
                         \overlap/  \___ own frames ___/      split iff overlap < own
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from mm_pipeline.media.decode.budget import DecodeControl
from mm_pipeline.media.decode.image import decode_animation_frames
from mm_pipeline.media.decode.video import VideoInfo, decode_range
from mm_pipeline.media.decode.video_containers import VideoContainers
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem


def plan_chunks(groups: Sequence[int], indices: Sequence[int], keyframes: Sequence[int], tp: int,
                groups_per_chunk: int, min_chunks: int = 0) -> list[list[int]]:
    """Cut ascending group numbers into chunks (see module doc). ``indices[g*tp + j]`` is the
    source frame of sampled frame j of group g; ``min_chunks``: see the module doc (the runtime
    passes 2 per decode worker when the decoder streams groups)."""
    if groups_per_chunk < 1 or min_chunks < 0:
        raise ValueError(f"groups_per_chunk must be >= 1 and min_chunks >= 0, got {groups_per_chunk}, {min_chunks}")
    num_groups = len(indices) // tp
    cap = math.ceil(len(groups) / min_chunks) if min_chunks else 1  # groups a chunk grows to to save a re-decode
    chunks: list[list[int]] = []
    for g in groups:
        prev = chunks[-1] if chunks else None
        if prev is not None and g == prev[-1] + 1:
            first = indices[g * tp]
            seek = max((k for k in keyframes if k <= first), default=0)
            overlap = indices[prev[-1] * tp + tp - 1] - seek + 1
            own = indices[min(g + groups_per_chunk, num_groups) * tp - 1] - first + 1
            if len(prev) < groups_per_chunk or overlap >= own or (overlap > 0 and len(prev) < cap):
                prev.append(g)
                continue
        chunks.append([g])
    return chunks


def decode_chunk(item: MediaItem, info: VideoInfo | None, indices: Sequence[int], groups: Sequence[int], tp: int,
                 limits: MediaLimits, size: tuple[int, int] | None = None,
                 control: DecodeControl | None = None, threads: int = 1,
                 on_group: Callable[[int, torch.Tensor], None] | None = None,
                 containers: VideoContainers | None = None) -> torch.Tensor:
    """Frames [len(groups) * tp, H, W, 3] uint8 of ``groups`` in order (``info`` None: a GIF/WebP
    animation, decoded with PIL), scaled to ``size`` (h, w) as they are decoded; ``threads``: the
    codec's own threads per decoder (decode_range). ``on_group(g, frames)``: called on this thread
    for each group in order with its [tp, H, W, 3] frames -- for a video as soon as the group's last
    frame is decoded, while the chunk's later groups still decode. ``containers``: the video's open
    containers to borrow from (video_containers.py)."""
    wanted = [indices[g * tp + j] for g in groups for j in range(tp)]
    targets = sorted(set(wanted))  # a padded tail repeats its last frame
    if info is None:
        frames = decode_animation_frames(item, targets, limits, size, control)
        relay = None
    else:
        relay = None if on_group is None else _GroupRelay(groups, wanted, targets, tp, on_group)
        frames = decode_range(item, info, targets, size=size, control=control, threads=threads, on_row=relay,
                              containers=containers)
    if wanted != targets:
        row = {t: k for k, t in enumerate(targets)}
        frames = frames[[row[t] for t in wanted]]
    if on_group is not None and relay is None:
        emit_groups(frames, groups, tp, on_group)
    return frames


def emit_groups(frames: torch.Tensor, groups: Sequence[int], tp: int,
                on_group: Callable[[int, torch.Tensor], None]) -> None:
    """``on_group`` for every group of a decoded chunk ``frames`` (a decoder that cannot stream)."""
    for k, g in enumerate(groups):
        on_group(g, frames[k * tp:(k + 1) * tp])


class _GroupRelay:
    """``decode_range``'s ``on_row``: collects rows and calls ``on_group`` once a group's rows are
    all in (targets ascend, so groups complete in order)."""

    def __init__(self, groups: Sequence[int], wanted: Sequence[int], targets: Sequence[int], tp: int,
                 on_group: Callable[[int, torch.Tensor], None]) -> None:
        pos = {t: k for k, t in enumerate(targets)}
        self._pending = [(g, [pos[wanted[k * tp + j]] for j in range(tp)]) for k, g in enumerate(groups)]
        self._rows: list[np.ndarray] = []
        self._on_group = on_group

    def __call__(self, k: int, rgb: np.ndarray) -> None:
        self._rows.append(rgb)
        while self._pending and max(self._pending[0][1]) < len(self._rows):
            g, rows = self._pending.pop(0)
            self._on_group(g, torch.from_numpy(np.stack([self._rows[r] for r in rows])))
