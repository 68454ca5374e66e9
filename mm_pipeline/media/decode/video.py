"""Video → sampled uint8 RGB frames with PyAV, optionally decoded in parallel frame ranges.

Frame numbering comes from one demux pass (no decoding): the presentation timestamps of all
packets, sorted, give every frame its index, and the keyframe flags give the seek points.

    frames   0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19
    keys     K         K         K              K
    sampled  *   *     *   *       *     *        *        *      (video_sampling)
    ranges   └── range 0 ──┘       └──── range 1 ──────────────┘  (cut at the keyframe nearest
                                                                   the equal split point)
    decoder 0: seek K@0, decode 0..6        decoder 1: seek K@10, decode 10..19

Each range gets its own container (PyAV objects are not shared across threads), seeks to the last
keyframe at or before its first sampled frame and decodes forward; a decoded frame is identified by
its pts, so a range produces exactly the frames a serial decode from frame 0 produces.  Sampled
frames the decoder never emits (a damaged or non-displayed tail packet) repeat the latest frame
decoded before them, in both modes alike.  GIF and WebP animations go through PIL instead.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import av
import numpy as np
import torch
from av.video.reformatter import VideoReformatter

from mm_pipeline.media.decode.budget import DecodeControl, check, check_frame_size
from mm_pipeline.media.decode.decoder_memory import (MAX_DPB, codec_threads, dpb_pictures, frame_bytes,
                                                     picture_bytes)
from mm_pipeline.media.decode.image import decode_animation_frames, probe_animation
from mm_pipeline.errors import MediaTooLarge, UndecodableMediaError
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import DecodedVideo, MediaItem
from mm_pipeline.media.av_container import open_av, unusable_video, video_stream
from mm_pipeline.media.decode.video_sampling import FrameSampling, VideoSamplingParams, sample_frames
from mm_pipeline.media.worker_pool import WorkerPool

if TYPE_CHECKING:  # video_chunks imports this module (its chunks decode through decode_range)
    from mm_pipeline.media.decode.video_chunks import VideoContainers

_ANIMATIONS = {"gif", "webp"}


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    video_fps: float
    pts: tuple[int, ...]  # pts of frame k (ascending) in ``time_base``
    keyframes: tuple[int, ...]  # frame indices where a decoder may start
    time_base: Fraction
    stream: int = 0  # the stream's index in its container (av_container.video_stream's choice)
    # the pixel limit it was probed under: every later open of the item passes it to FFmpeg
    # (av_container.open_av), so the stream probe inside the open sees the streams as the probe did
    max_pixels: int = MediaLimits().max_pixels
    # what its decoder holds (decoder_memory): pictures kept for reference and reordering, and the
    # bytes of one (its pixel format's planes and side tables); 0: not known, counted at the widest
    dpb: int = MAX_DPB
    picture_bytes: int = 0

    @property
    def total_frames(self) -> int:
        return len(self.pts)

    @property
    def duration_s(self) -> float:
        return self.total_frames / self.video_fps


def probe_video(item: MediaItem, limits: MediaLimits = MediaLimits(),
                control: DecodeControl | None = None) -> VideoInfo:
    """One demux pass over the video stream the media stages decode (``av_container.video_stream``:
    the first with a decoder and a size, not cover art); enforces pixel, frame and duration limits."""
    try:
        with open_av(item.data, max_pixels=limits.max_pixels, timeout_s=remaining_s(control)) as container:
            check(control)
            stream = video_stream(container)
            if stream is None:
                raise unusable_video(item.data, container, limits.max_pixels, f"{item.format} from {item.origin}")
            w, h = stream.codec_context.width, stream.codec_context.height
            if w * h > limits.max_pixels:
                raise MediaTooLarge(f"video frames are {w}x{h} = {w * h} pixels, limit {limits.max_pixels}")
            packets: list[tuple[int, bool]] = []
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue  # demuxer flush marker
                if len(packets) % 256 == 0:
                    check(control)
                if packet.pts is None:
                    raise UndecodableMediaError(f"{item.format} video has packets without timestamps")
                packets.append((packet.pts, packet.is_keyframe))
                if len(packets) > limits.max_frames:
                    raise MediaTooLarge(f"video has over {limits.max_frames} frames")
            rate = stream.average_rate or stream.guessed_rate
            time_base, index = stream.time_base, stream.index
            cc = stream.codec_context  # what the stream probe found: pixel format, reorder delay
            dpb = dpb_pictures(cc.name, cc.extradata, cc.reorder_depth)
            picture = picture_bytes(cc.name, frame_bytes(cc.format.name if cc.format else None, w, h), w * h)
    except av.FFmpegError as exc:
        check(control)  # (an open cut short by the deadline)
        raise UndecodableMediaError(f"{item.format} video from {item.origin} does not demux ({exc})") from exc
    if not packets:
        raise UndecodableMediaError(f"{item.format} video from {item.origin} has no frames")
    packets.sort()
    pts = tuple(p for p, _ in packets)
    fps = float(rate) if rate else _fps_from_pts(pts, time_base)
    keyframes = tuple(k for k, (_, key) in enumerate(packets) if key) or (0,)
    info = VideoInfo(w, h, fps, pts, keyframes if keyframes[0] == 0 else (0, *keyframes), time_base, index,
                     limits.max_pixels, dpb, picture)
    if info.duration_s > limits.max_duration_s:
        raise MediaTooLarge(f"video lasts {info.duration_s:.1f} s, limit {limits.max_duration_s} s")
    return info


def remaining_s(control: DecodeControl | None) -> float | None:
    """Seconds left of ``control``'s deadline, for an open (``open_av``'s ``timeout_s``); None
    without one (a control that only counts frames, as tests pass, has none either)."""
    return getattr(control, "remaining_s", None)


def _fps_from_pts(pts: tuple[int, ...], time_base: Fraction | None) -> float:
    span = (pts[-1] - pts[0]) * float(time_base or 0)
    return (len(pts) - 1) / span if len(pts) > 1 and span > 0 else 1.0


def decode_range(item: MediaItem, info: VideoInfo, targets: Sequence[int], seek: bool = True,
                 size: tuple[int, int] | None = None, control: DecodeControl | None = None,
                 threads: int = 1, on_row: Callable[[int, np.ndarray], None] | None = None,
                 drop_nonref: bool = True, containers: VideoContainers | None = None) -> torch.Tensor:
    """Frames ``targets`` (ascending, unique) as [T, H, W, 3] uint8; with ``seek`` the decoder
    starts at the last keyframe at or before ``targets[0]``, jumps over the frames between two
    targets when a keyframe lies between them (``decode_runs``) and, with ``drop_nonref``, drops
    the unsampled frames no other frame is predicted from (``skips_nonref``); else it decodes every
    frame from frame 0. ``size`` (h, w): frames are scaled to it by swscale as they leave the
    decoder, in uint8, so a huge source frame never exists as RGB, let alone as float (default: the
    stream's size). ``control``: checked once per decoded frame (deadline, cancellation).
    ``threads``: the codec's own decoding threads (FFmpeg frame/slice threads, outside the GIL);
    1: none, 0: FFmpeg picks by the CPU count. Output is bit-identical either way.
    ``on_row(k, rgb)``: called on the decoding thread as row k of the result is ready (in order),
    so a caller can hand on the first frames while later ones still decode. ``containers``: borrow
    an open container of ``item`` there instead of opening one (video_chunks.VideoContainers)."""
    h, w = size or (info.height, info.width)
    if not targets:
        return torch.empty(0, h, w, 3, dtype=torch.uint8)
    if any(b <= a for a, b in zip(targets, targets[1:])) or targets[0] < 0 or targets[-1] >= info.total_frames:
        raise ValueError(f"decode_range targets must be ascending, unique and in [0, {info.total_frames}), "
                         f"got {list(targets)[:8]}...")
    index_of = {p: k for k, p in enumerate(info.pts)}
    first = max((k for k in info.keyframes if k <= targets[0]), default=0) if seek else 0
    # rows are copied into the result as they come (torch copies outside the GIL; a final np.stack
    # of a long range held it for tens of ms, stalling the event loop)
    result = torch.empty(len(targets), h, w, 3, dtype=torch.uint8)
    out: list[np.ndarray] = []  # the result's rows so far (numpy views)
    prev: av.VideoFrame | None = None
    rgb = FrameToRgb(h, w)

    def put(frame: av.VideoFrame) -> None:
        row = result[len(out)]
        row.copy_(torch.from_numpy(rgb(frame)))
        out.append(row.numpy())
        if on_row is not None:
            on_row(len(out) - 1, out[-1])

    def walk(container: av.container.InputContainer, stream: av.VideoStream, start: int, until: int,
             wanted: frozenset[int] | None) -> bool:
        """Decode from where the container stands until ``until`` targets are out. ``wanted``: the
        targets' pts; every other packet's frame is dropped when no frame refers to it. False: a
        target never came out while frames were dropped (a damaged stream); the caller decodes
        the run again without dropping, so what stands in for it is what a full decode gives."""
        nonlocal prev
        cc = stream.codec_context
        mode = cc.skip_frame = "DEFAULT"  # (a borrowed container's decoder may have been left dropping)
        prev_index = start - 1
        for packet in container.demux(stream):
            if wanted is not None and mode != (want := "DEFAULT" if packet.pts is None or packet.pts in wanted
                                               else "NONREF"):
                mode = cc.skip_frame = want  # set on a change only: the setter looks the name up
            for frame in cc.decode(packet):
                check(control)
                check_frame_size(frame, info.width, info.height, f"{item.format} video from {item.origin}")
                idx = prev_index = index_of.get(frame.pts, prev_index + 1)
                if len(out) < until and targets[len(out)] < idx:
                    if wanted is not None:
                        return False
                    while len(out) < until and targets[len(out)] < idx:
                        put(prev if prev is not None else frame)  # never emitted
                if len(out) < until and targets[len(out)] == idx:
                    put(frame)
                prev = frame
                if len(out) == until:
                    return True
        return wanted is None or len(out) == until

    try:
        opened = containers.lend(control) if containers is not None else _opened(item, info, control)
        with opened as (container, fresh):
            if info.stream >= len(container.streams):  # an open the deadline cut short (streams found while probing)
                check(control)
                raise UndecodableMediaError(f"{item.format} video from {item.origin} lost its video stream")
            stream = container.streams[info.stream]  # the one probe_video walked
            used = codec_threads(threads, info.height * info.width)
            if used > 1 and fresh:
                stream.thread_type = "AUTO"
                stream.codec_context.thread_count = used
            # without ``seek`` (the serial reference) the decoder walks every frame from frame 0
            runs = decode_runs(targets, info.keyframes, first) if seek else [(0, len(targets))]
            wanted = frozenset(info.pts[t] for t in targets) if seek and drop_nonref and skips_nonref(stream) else None
            for start, until in runs:
                if start > 0 or not fresh:  # the seek flushes the decoder: no frame of the skipped gap comes out
                    container.seek(info.pts[start], stream=stream, backward=True, any_frame=False)
                    fresh = True
                if not walk(container, stream, start, until, wanted):
                    container.seek(info.pts[start], stream=stream, backward=True, any_frame=False)
                    walk(container, stream, start, until, None)
    except av.FFmpegError as exc:
        check(control)
        raise UndecodableMediaError(f"{item.format} video from {item.origin} does not decode ({exc})") from exc
    if prev is None:
        raise UndecodableMediaError(f"{item.format} video from {item.origin} decoded no frame")
    while len(out) < len(targets):
        put(prev)
    return result


# Decoders whose "non-reference" frame (FFmpeg's skip_frame NONREF) is one no other frame is ever
# predicted from: H.264 marks it in every slice (nal_ref_idc 0); in MPEG-1/2 and MPEG-4 part 2 it is
# a B-frame, never a reference. Dropping such a frame when it is not sampled leaves every other
# frame bit-identical. HEVC only with one temporal sub-layer (``hevc_single_sublayer``): its "_N"
# pictures are non-reference within their sub-layer only and may be referenced from a higher one
# (frame-rate-scalable streams). Not AV1 (libdav1d reads the setting once, at open) nor VP8/VP9
# (their encoders refresh a reference with every shown frame; nothing to gain).
SKIP_NONREF_CODECS = frozenset({"h264", "mpeg4", "mpeg1video", "mpeg2video"})


def skips_nonref(stream: av.VideoStream) -> bool:
    """Whether ``decode_range`` drops this stream's unsampled non-reference frames: on a 60 s 720p
    H.264 clip (x264 veryfast, a keyframe every 2 s, 1 frame sampled a second) 664 instead of 1254
    decoded frames, 0.45 s of CPU instead of 0.63 s (README "Media pipeline")."""
    name = stream.codec_context.name
    if name == "hevc":
        return hevc_single_sublayer(stream.codec_context.extradata)
    return name in SKIP_NONREF_CODECS


def hevc_single_sublayer(extradata: bytes | None) -> bool:
    """True when an HEVC stream's decoder configuration record (``hvcC``, what MP4 and Matroska
    carry) says the stream has exactly one temporal sub-layer, so a sub-layer non-reference picture
    is never referenced. Byte 21 holds numTemporalLayers in bits 5-3 (0: unknown). Anything else
    (no record, Annex B start codes as in MPEG-TS, a short or unknown record) is False."""
    if not extradata or len(extradata) < 23 or extradata[0] != 1:
        return False
    return (extradata[21] >> 3) & 0x7 == 1


@contextmanager
def _opened(item: MediaItem, info: VideoInfo,
            control: DecodeControl | None) -> Iterator[tuple[av.container.InputContainer, bool]]:
    """A container of ``item`` of its own (``VideoContainers.lend``'s shape), closed after."""
    with open_av(item.data, max_pixels=info.max_pixels, timeout_s=remaining_s(control)) as container:
        yield container, True


def decode_runs(targets: Sequence[int], keyframes: Sequence[int], first: int) -> list[tuple[int, int]]:
    """Where one decoder seeks while it walks ascending ``targets``: (start frame, number of targets
    done once this run ends) per run. The first run starts at ``first``; a later target with a
    keyframe after the previous target starts a run at that keyframe, so the frames between the
    two are never decoded (a keyframe decodes alone, so its run's frames are the ones a decode
    straight through gives):

        frames    0 ........ 30 ........ 60 ........ 90 ...     keyframes at 0 and 60
        targets   *          *           *           *
        runs      [0 ─────── 30]  skipped [60 ────── 90]        31 of 91 frames not decoded

    At 1-2 sampled frames a second and a keyframe every 2 s, that is up to a third of a chunk's
    decoding (a seek costs an index lookup and a decoder flush)."""
    runs: list[tuple[int, int]] = []
    start, last = first, first - 1
    keys = list(keyframes)
    for k, t in enumerate(targets):
        key = keys[bisect.bisect_right(keys, t) - 1] if keys and keys[0] <= t else 0
        if k and key > last + 1:
            runs.append((start, k))
            start = key
        last = t
    runs.append((start, len(targets)))
    return runs


class FrameToRgb:
    """Decoded frames -> [h, w, 3] uint8 RGB at one size (even if the codec changes resolution
    mid-stream), scaled by swscale as PyAV's ``to_ndarray(format="rgb24", width=w, height=h)`` does
    (bilinear) -- bit-identical (tested) -- but with one scaler for all of a decoder's frames and
    swscale's own threads off. ``to_ndarray`` sets up a new scaler per frame with swscale's
    automatic thread count, i.e. a thread pool started per frame: a 720p frame scaled to the demo
    model's 192x96 took 0.85-1.7 ms of CPU (up to 3.7 ms wall under load) that way and 0.8-1.05 ms
    (wall = CPU) this way. One instance per decoder thread (a scaler is not thread-safe)."""

    def __init__(self, h: int, w: int) -> None:
        self.h, self.w = h, w
        self._scaler = VideoReformatter()

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        return self._scaler.reformat(frame, format="rgb24", width=self.w, height=self.h, threads=1).to_ndarray()


def split_ranges(targets: Sequence[int], info: VideoInfo, num_ranges: int) -> list[list[int]]:
    """Split ascending unique ``targets`` into at most ``num_ranges`` runs.  Run boundaries sit on
    the keyframes nearest the equal split points, so every run's decoder starts at its own
    boundary and no frame is decoded by two decoders."""
    if num_ranges < 1:
        raise ValueError(f"num_ranges must be >= 1, got {num_ranges}")
    n = info.total_frames
    bounds = sorted({min(info.keyframes, key=lambda k: abs(k - n * i / num_ranges))
                     for i in range(1, num_ranges)} - {0})
    runs: list[list[int]] = [[] for _ in range(len(bounds) + 1)]
    for t in targets:
        runs[bisect.bisect_right(bounds, t)].append(t)
    return [run for run in runs if run]


class VideoDecoder:
    """Decodes a video item into the frames ``video_sampling`` picks, in ``num_ranges`` parallel
    ranges on ``pool`` (``decode``) or serially on the calling thread (``decode_sync``)."""

    def __init__(self, sampling: VideoSamplingParams = VideoSamplingParams(),
                 limits: MediaLimits = MediaLimits(), pool: WorkerPool | None = None,
                 num_ranges: int = 2, threads: int = 1) -> None:
        if num_ranges < 1 or threads < 0:
            raise ValueError(f"num_ranges must be >= 1 and threads >= 0, got {num_ranges}, {threads}")
        self.sampling = sampling
        self.limits = limits
        self.pool = pool
        self.num_ranges = num_ranges
        self.threads = threads  # codec threads per range (decode_range)

    async def decode(self, item: MediaItem) -> DecodedVideo:
        if self.pool is None:
            raise ValueError("VideoDecoder.decode needs a WorkerPool; use decode_sync without one")
        if item.format in _ANIMATIONS:
            return await self.pool.run(self.decode_sync, item)
        # everything but the awaiting runs on the pool: the event loop never copies frames
        info, sampling, targets, runs = await self.pool.run(self._plan, item)
        parts = await asyncio.gather(*(self.pool.run(decode_range, item, info, run, threads=self.threads)
                                       for run in runs))
        return await self.pool.run(self._assemble, item, info.video_fps, info.total_frames, sampling, targets,
                                   list(parts))

    def _plan(self, item: MediaItem) -> tuple[VideoInfo, FrameSampling, list[int], list[list[int]]]:
        info = probe_video(item, self.limits)
        sampling = sample_frames(info.total_frames, info.video_fps, self.sampling)
        targets = sorted(set(sampling.indices))
        return info, sampling, targets, split_ranges(targets, info, self.num_ranges)

    def decode_sync(self, item: MediaItem, parallel_ranges: bool = False) -> DecodedVideo:
        """Serial decode; with ``parallel_ranges`` the ranges ``decode`` would use run one after
        the other (each from its own seek point) — the equivalence tests compare the two."""
        if item.format in _ANIMATIONS:
            anim = probe_animation(item, self.limits)
            sampling = sample_frames(anim.num_frames, anim.fps, self.sampling)
            frames = decode_animation_frames(item, sampling.indices, self.limits)
            return DecodedVideo(frames, sampling.indices, sampling.timestamps, anim.fps,
                                anim.num_frames, item.format)
        info = probe_video(item, self.limits)
        sampling = sample_frames(info.total_frames, info.video_fps, self.sampling)
        targets = sorted(set(sampling.indices))
        if parallel_ranges:
            parts = [decode_range(item, info, run, threads=self.threads)
                     for run in split_ranges(targets, info, self.num_ranges)]
        else:
            parts = [decode_range(item, info, targets, seek=False, threads=self.threads)]
        return self._assemble(item, info.video_fps, info.total_frames, sampling, targets, parts)

    @staticmethod
    def _assemble(item: MediaItem, fps: float, total: int, sampling: FrameSampling, targets: list[int],
                  parts: list[torch.Tensor]) -> DecodedVideo:
        decoded = torch.cat(parts) if len(parts) > 1 else parts[0]
        row = {t: k for k, t in enumerate(targets)}
        frames = decoded[[row[i] for i in sampling.indices]]  # padded tail repeats a row
        return DecodedVideo(frames, sampling.indices, sampling.timestamps, fps, total, item.format)
