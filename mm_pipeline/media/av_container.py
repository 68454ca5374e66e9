"""Opening encoded media with PyAV -- the one way the media stages do -- and which of a
container's video streams they decode.

Every open (sniff, video probe and decode, the audio decoders, decodes of arriving bytes) goes
through ``open_av`` / ``open_av_stream``: nested protocol opens are off, so a crafted playlist
cannot make FFmpeg read local files or the network.

The stream the media stages decode (``video_stream``), the same for the sniff, the probe, every
decode and the decode of arriving bytes:

    streams.video   [0] cover art   [1] no decoder   [2] size 0   [3] 640x360   [4] ...
    video_stream    ──────────────── skipped ───────────────────►  3
"""

from __future__ import annotations

import io
from typing import BinaryIO

import av

from mm_pipeline.errors import UndecodableMediaError

_AV_OPTIONS = {"protocol_whitelist": "none"}


def open_av(data: bytes, format: str | None = None) -> av.container.InputContainer:
    """Open encoded bytes with PyAV, with nested protocol opens disabled."""
    try:
        return av.open(io.BytesIO(data), mode="r", format=format, options=dict(_AV_OPTIONS))
    except UnicodeDecodeError as exc:  # PyAV decodes container metadata as UTF-8 while opening
        raise UndecodableMediaError(f"media container metadata is not valid UTF-8 ({exc.reason})") from None


def open_av_stream(fileobj: BinaryIO) -> av.container.InputContainer:
    """``open_av`` for bytes still arriving (``ArrivingReader``). ``ignidx``: the MP4 demuxer
    stops reading top-level boxes at the first ``mdat``/``moof`` instead of walking every fragment
    before the first packet (which would wait for the last byte)."""
    try:
        return av.open(fileobj, mode="r", options={**_AV_OPTIONS, "fflags": "+ignidx"})
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


def unusable_video(container: av.container.InputContainer, what: str) -> UndecodableMediaError:
    """Why ``video_stream(container)`` found none (400): no video stream, no decoder here for it,
    or no frame size found (a damaged stream)."""
    candidates = _candidates(container)
    if not candidates:
        return UndecodableMediaError(f"{what} has no video stream")
    if all(s.codec_context is None for s in candidates):
        return UndecodableMediaError(f"{what}: no decoder here for its video stream"
                                     f"{'s' if len(candidates) > 1 else ''}")
    return UndecodableMediaError(f"{what}: its video stream has no frame size FFmpeg can read (damaged)")


def _candidates(container: av.container.InputContainer) -> list[av.VideoStream]:
    return [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
