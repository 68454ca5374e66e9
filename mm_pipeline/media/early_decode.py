r"""Decode a video while its bytes still arrive (issue 16 item 4; README "Decoding while bytes arrive").

    bytes ─► ArrivingBytes ─► early decoder thread: demux + decode front to back, keep the frames
                   │          sampling will probably pick (decoded YUV, converted later)
                   └─► finish: content key ─► sniff ─► plan (the exact demux on the whole bytes)
                                                   ─► chunks: kept frames, misses decoded as before

Which frames the model sees depends on the exact frame count (``video_sampling``), known only at
the end, so the early decoder *predicts* it -- exactly from an MP4 index (``stts``), from the
container's duration (Matroska/WebM), else from the bytes read so far against Content-Length --
and keeps the frames of the predicted sampling for a few counts around the prediction. Production
takes a kept frame by its pts (the same frame a decode from its keyframe emits) and decodes only
the targets that were not kept, so the frames are those of the whole-bytes path whatever the
prediction was; a wrong prediction costs time, never correctness.

Only containers that can be read front to back start one (``streamable_layout``): fragmented MP4,
MP4 with ``moov`` before ``mdat``, Matroska/WebM, Ogg. An MP4 with its index at the end would block
the decoder until the last byte, so it is decoded after arrival as before and holds no thread.
Bounds: ``max_kept_bytes`` of kept frames, a deadline, a cap on concurrent early decoders (none
free: the item is decoded after arrival), and ``cancel`` (a manifest/cache hit, the request
dropped its item, the body failed) stops the thread at its next packet and frees the frames.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Callable

import av
import numpy as np
import torch

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode_budget import DecodeControl, check
from mm_pipeline.media.decode_video import VideoInfo, codec_threads, decode_range
from mm_pipeline.media.ingest import MediaLimits
from mm_pipeline.media.sniff import open_av_stream
from mm_pipeline.media.types import MediaItem
from mm_pipeline.media.video_sampling import VideoSamplingParams, sample_frames

_SLACK = {"index": 0, "duration": 2, "bytes": 2}  # frame counts kept either side of the prediction


class EarlyVideoDecode:
    """One video decoded on its own thread while its bytes arrive; frames kept by pts.

    Invariant (under ``_cond``): every kept frame's pts <= ``_last_pts``; once ``_ended`` the set of
    kept frames no longer grows."""

    def __init__(self, body: ArrivingBytes, layout: str, sampling: VideoSamplingParams, max_kept_bytes: int,
                 timeout_s: float, threads: int = 1, on_end: Callable[[], None] | None = None) -> None:
        self.body = body
        self.layout = layout  # sniff.streamable_layout's answer
        self.received_at_start = body.received  # bytes in when decoding started (the rest: outstanding)
        self.sampling = sampling
        self.max_kept_bytes = max_kept_bytes
        self.threads = threads
        self.control = DecodeControl(timeout_s, what="an arriving video")
        self.received_at_first_frame: int | None = None  # bytes in when the first frame came out
        self.prediction = ""  # how the frame count was predicted: index / duration / bytes
        self._on_end = on_end
        self._cond = threading.Condition()
        self._frames: dict[int, av.VideoFrame] = {}
        self._kept_bytes = 0
        self._last_pts: int | None = None
        self._stop_pts: int | None = None  # production needs nothing after this pts
        self._per_byte = 0.0  # frames per byte of the whole GOPs read so far (the "bytes" prediction)
        self._ended = False
        self._dropped = False  # cancelled: keep nothing more
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mmserve-early-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop at the next packet and drop the kept frames (safe from any thread, any number of times)."""
        self.control.cancel()
        with self._cond:
            self._dropped = True
            self._frames.clear()
            self._kept_bytes = 0
            self._cond.notify_all()

    def stop_after(self, pts: int) -> None:
        """Production needs no frame after ``pts``: the decoder stops once it is past it."""
        with self._cond:
            self._stop_pts = pts

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def last_pts(self) -> int | None:
        with self._cond:
            return self._last_pts

    @property
    def ended(self) -> bool:
        with self._cond:
            return self._ended

    def frames_until(self, wanted: Sequence[int], control: DecodeControl | None = None) -> dict[int, av.VideoFrame]:
        """Wait until the decoder is past the last of the ``wanted`` pts (or ended); the kept
        frames among them (the rest: not kept, decode them)."""
        last = max(wanted)
        with self._cond:
            while not self._ended and (self._last_pts is None or self._last_pts < last):
                self._cond.wait(0.05)
                check(control)
            return {p: self._frames.pop(p) for p in wanted if p in self._frames}

    # ---- the decoder thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            with open_av_stream(self.body.reader()) as container:
                if container.streams.video:
                    self._decode(container, container.streams.video[0])
        except BaseException as exc:  # a body that failed, a damaged stream, cancel, deadline
            self._error = exc
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()
            if self._on_end is not None:
                self._on_end()

    def _decode(self, container: av.container.InputContainer, stream: av.VideoStream) -> None:
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        if not fps > 0:
            return  # no rate: no prediction (decoded after arrival)
        width, height = stream.codec_context.width, stream.codec_context.height
        frame_bytes = width * height * 3 // 2  # a kept frame stays YUV 4:2:0 until production converts it
        used = codec_threads(self.threads, width * height)
        if used > 1:  # as decode_range does: FFmpeg's own threads, output bit-identical
            stream.thread_type = "AUTO"
            stream.codec_context.thread_count = used
        keep: set[int] = set()
        predicted = -1
        index = 0
        for packet in container.demux(stream):
            check(self.control)
            for frame in packet.decode():
                if self.received_at_first_frame is None:
                    self.received_at_first_frame = self.body.received
                total = self._predict(container, stream, fps, index, packet)
                if total != predicted:
                    predicted, keep = total, self._targets(total, fps)
                with self._cond:
                    if (index in keep and not self._dropped
                            and self._kept_bytes + frame_bytes <= self.max_kept_bytes):
                        self._frames[frame.pts] = frame
                        self._kept_bytes += frame_bytes
                    self._last_pts = frame.pts if self._last_pts is None else max(self._last_pts, frame.pts)
                    self._cond.notify_all()
                    if self._stop_pts is not None and self._last_pts >= self._stop_pts:
                        return
                index += 1

    def _predict(self, container: av.container.InputContainer, stream: av.VideoStream, fps: float,
                 index: int, packet: av.Packet) -> int:
        if self.layout == "index" and stream.frames > 0:  # the MP4 sample table counts them exactly
            self.prediction = "index"
            return stream.frames
        if self.layout == "matroska" and container.duration:  # the Segment's duration (microseconds)
            self.prediction = "duration"
            return max(1, round(container.duration / 1e6 * fps))
        expected = self.body.expected_bytes or (self.body.received if self.body.done else None)
        if expected and packet.pos is not None and packet.pos > 0:
            # frames per byte over whole GOPs (the bytes before a keyframe), so the estimate does
            # not swing with each big keyframe; within the first GOP, over what has been read
            if packet.is_keyframe and index > 0:
                self._per_byte = index / packet.pos
            per_byte = self._per_byte or (index + 1) / (packet.pos + packet.size)
            self.prediction = "bytes"
            return max(index + 1, round(per_byte * expected))
        return index + 1

    def _targets(self, total: int, fps: float) -> set[int]:
        slack = _SLACK.get(self.prediction, 2)
        out: set[int] = set()
        for n in range(max(1, total - slack), total + slack + 1):
            out.update(sample_frames(n, fps, self.sampling).indices)
        return out


def decode_chunk_early(early: EarlyVideoDecode, item: MediaItem, info: VideoInfo, indices: Sequence[int],
                       groups: Sequence[int], tp: int, size: tuple[int, int], control: DecodeControl | None,
                       threads: int = 1) -> tuple[torch.Tensor, int]:
    """``video_chunks.decode_chunk`` with the early decoder's frames: (frames, how many targets
    came from it). Targets it did not keep are decoded from their keyframe as before."""
    wanted = [indices[g * tp + j] for g in groups for j in range(tp)]
    targets = sorted(set(wanted))
    h, w = size
    kept = early.frames_until([info.pts[t] for t in targets], control)
    rows: dict[int, np.ndarray] = {}
    for t in targets:
        frame = kept.get(info.pts[t])
        if frame is not None:
            rows[t] = frame.to_ndarray(format="rgb24", width=w, height=h)  # as decode_video converts
    missing = [t for t in targets if t not in rows]
    if missing:
        decoded = decode_range(item, info, missing, size=size, control=control, threads=threads)
        rows.update({t: decoded[k].numpy() for k, t in enumerate(missing)})
    frames = torch.from_numpy(np.stack([rows[t] for t in wanted]))
    return frames, len(targets) - len(missing)


class EarlyDecoders:
    """Starts the early decodes of one runtime (``MediaIngestor.early_video``): at most ``limit``
    threads at once (none free: the video is decoded after arrival, as without this feature)."""

    def __init__(self, sampling: VideoSamplingParams, limits: MediaLimits, fetch_timeout_s: float,
                 threads: int = 1, limit: int = 4) -> None:
        if limit < 1:
            raise ValueError(f"EarlyDecoders limit must be >= 1, got {limit}")
        self.sampling = sampling
        self.limits = limits
        # arrival is bounded by the fetch deadline, the decode after it by the decode deadline
        self.timeout_s = fetch_timeout_s + limits.decode_timeout_s
        self.threads = threads
        self._slots = threading.BoundedSemaphore(limit)

    def start(self, body: ArrivingBytes, layout: str) -> EarlyVideoDecode | None:
        if not self._slots.acquire(blocking=False):
            return None
        # kept frames: at most half the request's decoded-bytes budget (production converts them
        # under its own reservations, as it does frames it decodes itself)
        early = EarlyVideoDecode(body, layout, self.sampling, self.limits.max_request_decoded_bytes // 2,
                                 self.timeout_s, self.threads, on_end=self._slots.release)
        early.start()
        return early


def chunks_for_early(early: EarlyVideoDecode, info: VideoInfo, indices: Sequence[int],
                     chunks: Sequence[Sequence[int]], tp: int) -> set[int]:
    """Which ``chunks`` (positions) take the early decoder's frames: all once it has ended, else
    those whose seek point it has reached (a decoder of their own would redo what it is doing);
    the others decode from their keyframes in parallel. It stops after the last frame it serves
    (cancelled when it serves none)."""
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
        early.cancel()
    return chosen
