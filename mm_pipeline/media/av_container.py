"""Opening encoded media with PyAV -- the one way the media stages do -- and which of a
container's video streams they decode.

Every open (sniff, video probe and decode, the audio decoders, decodes of arriving bytes) goes
through ``open_av`` / ``open_av_stream``: nested protocol opens are off, so a crafted playlist
cannot make FFmpeg read local files or the network, and FFmpeg's stream probe
(``avformat_find_stream_info``, which runs inside every open and decodes a first frame of each
stream whose header leaves its parameters open) decodes no frame over ``max_pixels``. Without
that, a 2.2 MB MOV declaring one 12000x12000 RGBA64 PNG frame cost 5.5 s and 1.1 GB inside the
open, before any limit was looked at. With it, the decoder refuses the size as it opens; the
stream's size then reads 0 (a PNG's size is in its frames) or what its header or parameter sets
state (H.264), which the pixel check refuses as before (``unusable_video``).

The stream the media stages decode (``video_stream``), the same for the sniff, the probe, every
decode and the decode of arriving bytes:

    streams.video   [0] cover art   [1] no decoder   [2] size 0   [3] 640x360   [4] ...
    video_stream    ──────────────── skipped ───────────────────►  3
"""

from __future__ import annotations

import io
from typing import BinaryIO

import av

from mm_pipeline.errors import MediaError, MediaTooLarge, UndecodableMediaError
from mm_pipeline.media.ingest_config import MediaLimits

DEFAULT_MAX_PIXELS = MediaLimits().max_pixels
# ``max_pixels`` of an open that reads no video (the audio decoders, which open without saying):
# its stream probe decodes no video frame at all, so an audio item's container costs nothing for
# a video track it carries, whatever that track's size. Video callers pass their pixel limit.
NO_VIDEO_FRAMES = 1
_AV_OPTIONS = {"protocol_whitelist": "none"}
_INT_MAX = (1 << 31) - 1  # FFmpeg's range for the max_pixels option (a value past it fails the decoder's open)


def open_av(data: bytes, format: str | None = None, max_pixels: int = NO_VIDEO_FRAMES,
            timeout_s: float | None = None) -> av.container.InputContainer:
    """Open encoded bytes with PyAV: nested protocol opens disabled, no frame over ``max_pixels``
    decoded by the stream probe (module doc); ``timeout_s``: the probe stops reading packets once
    it has passed (FFmpeg checks between them; the caller's next deadline check then raises), so
    the open counts against an item's deadline."""
    timeout = None if timeout_s is None else (max(timeout_s, 0.0), None)  # (open, read): reads are checked per frame
    try:
        return av.open(io.BytesIO(data), mode="r", format=format, options=_options(max_pixels), timeout=timeout)
    except UnicodeDecodeError as exc:  # PyAV decodes container metadata as UTF-8 while opening
        raise UndecodableMediaError(f"media container metadata is not valid UTF-8 ({exc.reason})") from None


def open_av_stream(fileobj: BinaryIO, max_pixels: int = NO_VIDEO_FRAMES) -> av.container.InputContainer:
    """``open_av`` for bytes still arriving (``ArrivingReader``). ``ignidx``: the MP4 demuxer
    stops reading top-level boxes at the first ``mdat``/``moof`` instead of walking every fragment
    before the first packet (which would wait for the last byte)."""
    try:
        return av.open(fileobj, mode="r", options={**_options(max_pixels), "fflags": "+ignidx"})
    except UnicodeDecodeError as exc:
        raise UndecodableMediaError(f"media container metadata is not valid UTF-8 ({exc.reason})") from None


def video_stream(container: av.container.InputContainer) -> av.VideoStream | None:
    """The video stream the media stages decode: the first that is not cover art, has a decoder
    here (PyAV's ``codec_context`` is None otherwise) and a frame size; None: there is none."""
    for stream in _candidates(container):
        cc = stream.codec_context
        if cc is not None and cc.width > 0 and cc.height > 0:
            return stream
    return None


def sizeless_video(container: av.container.InputContainer) -> list[int]:
    """Indices of the video streams (not cover art) that have a decoder but read no frame size:
    FFmpeg refused their size under the ``max_pixels`` the container was opened with, or found
    none (a damaged stream)."""
    return [s.index for s in _candidates(container)
            if s.codec_context is not None and not (s.codec_context.width > 0 and s.codec_context.height > 0)]


def oversized_video(data: bytes, container: av.container.InputContainer, max_pixels: int) -> tuple[int, int] | None:
    """(width, height) its header states, over ``max_pixels``, of the first ``sizeless_video``
    stream of ``container`` (opened from ``data``) that has one; None when none has. The sizes
    come from a second open that runs no decoder (FFmpeg's ``codec_whitelist``), made only when a
    stream read no size. Most headers state one (MOV, Matroska, AVI, WebM); MPEG-4 part 2 in MP4
    reads 0 there too."""
    sizeless = sizeless_video(container)
    if not sizeless:
        return None
    try:
        with av.open(io.BytesIO(data), mode="r", options={**_AV_OPTIONS, "codec_whitelist": "none"}) as header:
            for index in sizeless:
                cc = header.streams[index].codec_context
                if cc is not None and cc.width * cc.height > max_pixels:
                    return cc.width, cc.height
    except (av.FFmpegError, UnicodeDecodeError, IndexError):
        return None
    return None


def unusable_video(data: bytes, container: av.container.InputContainer, max_pixels: int, what: str) -> MediaError:
    """Why ``video_stream(container)`` found none. A stream with a decoder whose size FFmpeg
    refused or could not find is the pixel limit's ``MediaTooLarge`` (413), naming the size its
    header states over ``max_pixels`` where it states one; the two cannot be told apart without
    the decode the limit avoids, and a size over the limit is the likelier (a damaged stream
    fails its decode as well). Else ``UndecodableMediaError`` (400): no video stream, or no
    decoder here for it."""
    if sizeless_video(container):
        oversized = oversized_video(data, container, max_pixels)
        if oversized is not None:
            w, h = oversized
            return MediaTooLarge(f"video frames are {w}x{h} = {w * h} pixels, limit {max_pixels}")
        return MediaTooLarge(f"{what}: its video frames are over the limit of {max_pixels} pixels, "
                             f"or of a size FFmpeg cannot read")
    candidates = _candidates(container)
    if not candidates:
        return UndecodableMediaError(f"{what} has no video stream")
    return UndecodableMediaError(f"{what}: no decoder here for its video stream{'s' if len(candidates) > 1 else ''}")


def _options(max_pixels: int) -> dict[str, str]:
    return {**_AV_OPTIONS, "max_pixels": str(min(max(max_pixels, 1), _INT_MAX))}


def _candidates(container: av.container.InputContainer) -> list[av.VideoStream]:
    return [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
