"""Write a ``VideoSpec`` as MP4 (H.264, yuv420p) or WebM (VP9, yuv420p) with PyAV.

The shape never moves, so only one frame per colour is rendered and converted to yuv420p; every
video frame reuses one of those ``k`` images (cheap even for 60 s at 30 fps). A beeping video also
gets a mono sound track (``samples.synthetic.audio_gen.synthesize`` of its beeps): AAC in MP4,
Opus in WebM.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from samples.synthetic.audio_gen import synthesize
from samples.synthetic.draw import render
from samples.synthetic.spec import VideoSpec

# the sound track of a beeping video: container format -> (codec, sample format)
_SOUND: dict[str, tuple[str, str]] = {"mp4": ("aac", "fltp"), "webm": ("libopus", "flt")}
# (container format, codec, encoder options). x264: constant quality, fast preset. VP9: realtime
# deadline + high cpu-used keeps encoding fast; crf with b=0 selects constant-quality mode.
_ENCODERS: dict[str, tuple[str, str, dict[str, str]]] = {
    "mp4": ("mp4", "libx264", {"crf": "23", "preset": "veryfast"}),
    "webm": ("webm", "libvpx-vp9", {"crf": "32", "b": "0", "deadline": "realtime",
                                    "cpu-used": "8", "row-mt": "1"}),
}


def render_colour_frames(spec: VideoSpec) -> list[np.ndarray]:
    """One H x W x 3 uint8 RGB frame per entry of ``spec.colours``, exact (before coding)."""
    return [render(spec.width, spec.height, spec.gray, (replace(spec.shape, colour=c),))
            for c in spec.colours]


def write_video(spec: VideoSpec, path: str | Path, threads: int = 1) -> Path:
    """Encode ``spec`` to ``path`` in ``spec.format``; returns the path.

    ``threads`` is the encoder thread count (1 by default: the generator itself is the parallel unit).
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    path = Path(path)
    container_fmt, codec, options = _ENCODERS[spec.format]
    with av.open(str(path), mode="w", format=container_fmt) as container:
        stream = container.add_stream(codec, rate=spec.fps, options=dict(options))
        stream.width, stream.height = spec.width, spec.height
        stream.pix_fmt = "yuv420p"
        # Frames count in 1/fps ticks. Keep our own copy: the muxer rewrites stream.time_base
        # (e.g. to 1/15360 for MP4) once the header is written.
        frame_tb = Fraction(1, spec.fps)
        stream.time_base = frame_tb
        stream.codec_context.thread_count = threads
        sound = _sound_stream(container, spec) if spec.beeps else None  # streams exist before the header
        # yuv420p planes as one (H * 3/2) x W array per colour, converted once.
        yuv = [av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p").to_ndarray()
               for rgb in render_colour_frames(spec)]
        for i in range(spec.n_frames):
            # A fresh frame object per pts: the encoder may still hold earlier frames in its queue.
            out = av.VideoFrame.from_ndarray(yuv[spec.colour_index(i)], format="yuv420p")
            out.pts = i
            out.time_base = frame_tb
            for packet in stream.encode(out):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
        if sound is not None:
            _write_sound(container, sound, spec)
    return path


def _sound_stream(container: av.container.OutputContainer, spec: VideoSpec) -> av.AudioStream:
    codec, fmt = _SOUND[spec.format]
    stream = container.add_stream(codec, rate=spec.sample_rate)
    ctx = stream.codec_context
    ctx.layout, ctx.format = "mono", fmt
    ctx.time_base = Fraction(1, spec.sample_rate)
    return stream


def _write_sound(container: av.container.OutputContainer, stream: av.AudioStream, spec: VideoSpec) -> None:
    """The beeps (silence elsewhere) for the whole video, mono, as the container's second stream."""
    ctx = stream.codec_context
    fmt = _SOUND[spec.format][1]
    signal = synthesize(spec)
    signal = np.pad(signal, (0, max(0, int(round(spec.duration_s * spec.sample_rate)) - len(signal))))
    chunk = ctx.frame_size or 1024
    for offset in range(0, len(signal), chunk):
        frame = av.AudioFrame.from_ndarray(signal[None, offset:offset + chunk].copy(), format=fmt, layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = spec.sample_rate, offset, ctx.time_base
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)
