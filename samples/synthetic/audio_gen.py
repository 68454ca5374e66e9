"""Synthesise an ``AudioSpec`` (sine beeps with 10 ms linear fades) and write it with PyAV.

Formats: WAV (PCM s16le), FLAC (s16), MP3 (libmp3lame), OGG/Opus (libopus, 48 kHz). Stereo files carry
the same signal in both channels.

One beep of n samples starting at sample ``start`` (fade f = round(10 ms * rate) samples)::

    envelope  0 /‾‾‾‾‾‾‾‾‾‾‾‾‾‾\\ 0
              |f|            |f|
    samples   start ........ start + n
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from samples.synthetic.spec import BEEP_FADE_S, AudioSpec

# spec format -> (container, codec, sample format, bit rate or None). Packed formats ("s16", "flt")
# take one interleaved row; planar ("fltp") one row per channel.
_ENCODERS: dict[str, tuple[str, str, str, int | None]] = {
    "wav": ("wav", "pcm_s16le", "s16", None),
    "flac": ("flac", "flac", "s16", None),
    "mp3": ("mp3", "libmp3lame", "fltp", 96_000),
    "opus": ("ogg", "libopus", "flt", 64_000),
}
_CHUNK = 4096   # samples per frame for codecs without a fixed frame size


def synthesize(spec: AudioSpec) -> np.ndarray:
    """The mono signal, float32 in [-1, 1], ``round(duration_s * sample_rate)`` samples (+1 at most)."""
    sr = spec.sample_rate
    spans = [(int(round(b.start_s * sr)), int(round(b.length_s * sr))) for b in spec.beeps]
    # Rounding start and length separately can overshoot a near-zero trailing silence by one sample.
    total = max(int(round(spec.duration_s * sr)), max(start + n for start, n in spans))
    out = np.zeros(total, dtype=np.float64)
    fade = int(round(BEEP_FADE_S * sr))
    for beep, (start, n) in zip(spec.beeps, spans):
        t = np.arange(n, dtype=np.float64) / sr
        env = np.ones(n, dtype=np.float64)
        ramp = np.arange(fade, dtype=np.float64) / fade      # 0 .. (f-1)/f, linear
        env[:fade] = ramp
        env[n - fade:] = ramp[::-1]
        out[start:start + n] += beep.amplitude * env * np.sin(2.0 * np.pi * beep.freq_hz * t)
    return out.astype(np.float32)


def _to_frame_array(chunk: np.ndarray, channels: int, sample_fmt: str) -> np.ndarray:
    """Lay out a mono chunk as PyAV expects for ``sample_fmt`` with ``channels`` copies."""
    if sample_fmt == "s16":
        pcm = np.clip(np.rint(chunk * 32767.0), -32768, 32767).astype(np.int16)
        return np.repeat(pcm, channels)[None, :]               # interleaved L R L R ...
    if sample_fmt == "flt":
        return np.repeat(chunk, channels)[None, :]
    if sample_fmt == "fltp":
        return np.tile(chunk, (channels, 1))                    # one plane per channel
    raise ValueError(f"unsupported sample format {sample_fmt!r}")


def write_audio(spec: AudioSpec, path: str | Path) -> Path:
    """Synthesise ``spec`` and encode it to ``path`` in ``spec.format``; returns the path."""
    path = Path(path)
    container_fmt, codec, sample_fmt, bit_rate = _ENCODERS[spec.format]
    signal = synthesize(spec)
    layout = "mono" if spec.channels == 1 else "stereo"
    with av.open(str(path), mode="w", format=container_fmt) as container:
        stream = container.add_stream(codec, rate=spec.sample_rate)
        ctx = stream.codec_context
        ctx.layout, ctx.format = layout, sample_fmt
        ctx.time_base = Fraction(1, spec.sample_rate)
        if bit_rate is not None:
            ctx.bit_rate = bit_rate
        ctx.open()   # opening fixes frame_size for codecs that need whole frames (MP3 1152, Opus 960)
        chunk = ctx.frame_size or _CHUNK
        for offset in range(0, len(signal), chunk):
            piece = signal[offset:offset + chunk]   # the last piece may be short: both lossy
            frame = av.AudioFrame.from_ndarray(     # encoders accept a small last frame
                _to_frame_array(piece, spec.channels, sample_fmt), format=sample_fmt, layout=layout)
            frame.sample_rate = spec.sample_rate
            frame.pts = offset
            frame.time_base = ctx.time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path
