r"""Which source frames each streaming chunk of a video decodes; the open containers its chunks share;
which chunks take the frames a decoder kept while the bytes arrived.

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

The chunks of one video share open PyAV containers (``VideoContainers``), closed together. Each
chunk used to open the file again, and opening an H.264 MP4 runs FFmpeg's stream probe, which
decodes frames until it has guessed the stream's reorder delay: ~10 ms of CPU per open at 720p (an
MPEG-4 part 2 file: 0.4 ms). A 60 s clip cut into 30 one-group chunks paid 0.3 s of its ~1 s of
decode CPU on opens. A chunk now borrows a container another chunk of the same video has finished
with; the decoder seeks (which flushes it) before its first frame, so the frames are those of a
fresh open.

    chunk 0 ─ open ─ decode ─ return ┐           chunk 2 ─ borrow ─ seek ─ decode ─ return
    chunk 1 ─ open ─ decode ─ return ┴─ free: [c0, c1] ─────┘          ...  close() at the end

At most as many containers are open as chunks decode at once (the decode workers). An idle one
holds its decoder's frames, so it is kept only while the decode budget's non-waiting share has room
for them (``DecodeBudget.take_idle``, from the share early decodes use) and no reservation waits:
a server decoding many videos at once closes containers as before rather than hold decoder memory
outside the budget. A reservation that must wait has the idle ones closed (``release_idle``): the
next chunk of the same video may need their bytes, and reserves before it can borrow one. The owner
(the video's production) calls ``close`` when the video is done, whatever happened; a container
lent at that moment is closed when it comes back.

A video decoded while its bytes arrived (``early.EarlyVideoDecode``) hands its kept frames to the
chunks whose seek point it has reached (``chunks_for_early``); such a chunk takes them by pts and
decodes the targets not kept from their keyframe as above (``decode_chunk_early``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Sequence

import av
import numpy as np
import torch

from mm_pipeline.media.decode.budget import DecodeBudget, DecodeControl
from mm_pipeline.media.decode.image import AnimationInfo, decode_animation_frames
from mm_pipeline.media.decode.video import FrameToRgb, VideoInfo, decode_range, remaining_s
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.av_container import DEFAULT_MAX_PIXELS, open_av
from mm_pipeline.media.types import MediaItem

if TYPE_CHECKING:  # annotations only: the chunks call an early decode's methods, never start one
    from mm_pipeline.media.decode.early import EarlyVideoDecode


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


def decode_chunk(item: MediaItem, info: VideoInfo | AnimationInfo | None, indices: Sequence[int],
                 groups: Sequence[int], tp: int,
                 limits: MediaLimits, size: tuple[int, int] | None = None,
                 control: DecodeControl | None = None, threads: int = 1,
                 on_group: Callable[[int, torch.Tensor], None] | None = None,
                 containers: VideoContainers | None = None) -> torch.Tensor:
    """Frames [len(groups) * tp, H, W, 3] uint8 of ``groups`` in order (``info`` not a VideoInfo --
    an AnimationInfo, or None: a GIF/WebP animation, decoded with PIL), scaled to ``size`` (h, w) as they are decoded; ``threads``: the
    codec's own threads per decoder (decode_range). ``on_group(g, frames)``: called on this thread
    for each group in order with its [tp, H, W, 3] frames -- for a video as soon as the group's last
    frame is decoded, while the chunk's later groups still decode. ``containers``: the video's open
    containers to borrow from (``VideoContainers``)."""
    wanted = [indices[g * tp + j] for g in groups for j in range(tp)]
    targets = sorted(set(wanted))  # a padded tail repeats its last frame
    if not isinstance(info, VideoInfo):
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


# ---- chunks served by an early decoder (module doc) ----------------------------------------------
def chunks_for_early(early: EarlyVideoDecode, info: VideoInfo, indices: Sequence[int],
                     chunks: Sequence[Sequence[int]], tp: int) -> set[int]:
    """Which ``chunks`` (positions) take the early decoder's frames: all once it has ended, else
    those whose seek point it has reached (a decoder of their own would redo what it is doing);
    the others decode from their keyframes in parallel. From here on it keeps the exact frames
    (``retarget``) and stops after the last frame it serves (cancelled when it serves none)."""
    if (early.ended and not early.prediction) or early.stream_index not in (None, info.stream):
        # it never decoded (no frame count up front), or another stream than the probe walked
        early.cancel_frames()  # (the same choice on the same bytes: not expected): decode as after arrival
        return set()
    early.retarget([info.pts[t] for t in indices])
    done, last = early.ended, early.last_pts
    chosen: set[int] = set()
    need = -1
    for c, groups in enumerate(chunks):
        first = indices[groups[0] * tp]
        seek = max((k for k in info.keyframes if k <= first), default=0)
        if done or (last is not None and info.pts[seek] <= last):
            chosen.add(c)
            need = max(need, info.pts[indices[groups[-1] * tp + tp - 1]])
    if chosen:
        early.stop_after(need)
    else:
        early.cancel_frames()
    return chosen


def decode_chunk_early(early: EarlyVideoDecode, item: MediaItem, info: VideoInfo, indices: Sequence[int],
                       groups: Sequence[int], tp: int, size: tuple[int, int], control: DecodeControl | None,
                       threads: int = 1) -> tuple[torch.Tensor, int]:
    """``decode_chunk`` with the early decoder's frames: (frames, how many targets
    came from it). Targets it did not keep are decoded from their keyframe as before."""
    wanted = [indices[g * tp + j] for g in groups for j in range(tp)]
    targets = sorted(set(wanted))
    h, w = size
    kept = early.frames_until([info.pts[t] for t in targets], control)
    rows: dict[int, np.ndarray] = {}
    rgb = FrameToRgb(h, w)  # as decode_range converts
    for t in targets:
        frame = kept.get(info.pts[t])
        if frame is not None:
            rows[t] = rgb(frame)
    missing = [t for t in targets if t not in rows]
    if missing:
        decoded = decode_range(item, info, missing, size=size, control=control, threads=threads)
        rows.update({t: decoded[k].numpy() for k, t in enumerate(missing)})
    frames = torch.from_numpy(np.stack([rows[t] for t in wanted]))
    return frames, len(targets) - len(missing)


class VideoContainers:
    """Containers of ``item`` for ``decode_range``; every borrower must use one codec-thread
    setting (it is fixed when a container's decoder opens). ``budget``/``idle_bytes``: an idle
    container holds ``idle_bytes`` of ``budget`` (its decoder's frames) or is closed."""

    def __init__(self, item: MediaItem, budget: DecodeBudget | None = None, idle_bytes: int = 0,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.item = item
        self.max_pixels = max_pixels  # what the containers are opened with (VideoInfo.max_pixels)
        self.budget = budget
        self.idle_bytes = idle_bytes
        self.opened = 0  # containers opened so far (the counter video_containers_opened)
        self._free: list[av.container.InputContainer] = []
        self._lock = threading.Lock()
        self._closed = False
        if budget is not None:
            budget.add_idle_holder(self)  # a waiting reservation closes the idle ones (module doc)

    @contextmanager
    def lend(self, control: DecodeControl | None = None) -> Iterator[tuple[av.container.InputContainer, bool]]:
        """``(container, fresh)``: fresh is True when just opened (not positioned by an earlier
        decode; the open counts against ``control``'s deadline). A decode that raised closes its
        container rather than handing it on."""
        with self._lock:  # (after close: a container of its own, closed after, as without this)
            container = self._free.pop() if self._free else None
        if container is not None and self.budget is not None:
            self.budget.release_early(self.idle_bytes)
        fresh = container is None
        if container is None:
            container = open_av(self.item.data, max_pixels=self.max_pixels, timeout_s=remaining_s(control))
            with self._lock:
                self.opened += 1
        done = False
        try:
            yield container, fresh
            done = True
        finally:
            with self._lock:
                keep = done and not self._closed and (self.budget is None or self.budget.take_idle(self.idle_bytes))
                if keep:
                    self._free.append(container)
            if not keep:
                container.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self.budget is not None:
            self.budget.remove_idle_holder(self)
        self.release_idle()

    def release_idle(self) -> None:
        """Close the idle containers and give their bytes back (a waiting reservation of the
        ``DecodeBudget`` asks, and ``close``). Lent ones come back later as usual."""
        with self._lock:
            free, self._free = self._free, []
        for container in free:
            container.close()
            if self.budget is not None:
                self.budget.release_early(self.idle_bytes)
