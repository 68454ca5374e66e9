"""Tiny media files generated in memory for the media-stage tests (PIL for images, PyAV for audio
and video).  Video frame k is painted with a gray level that encodes k, so tests can tell which
source frame a decoded frame came from despite lossy codecs."""

from __future__ import annotations

import io
import math
import struct

import av
import numpy as np
from PIL import Image


def frame_level(k: int) -> int:
    """Gray level painted on video frame k (steps of 9 survive lossy coding; wraps after 28)."""
    return 8 + 9 * (k % 28)


def level_to_frame(level: float, hint: int) -> int:
    """Invert ``frame_level`` near ``hint`` (levels repeat every 28 frames)."""
    base = round((level - 8) / 9) % 28
    return min((hint - hint % 28 + base + d for d in (-28, 0, 28)), key=lambda k: abs(k - hint))


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (64, 48), mode: str = "RGB", **save) -> bytes:
    """A gradient image in ``mode`` saved as ``fmt``."""
    w, h = size
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None].repeat(w, 1)
    rgb = np.stack([x, y, 255 - x], axis=2).astype(np.uint8)
    img = Image.fromarray(rgb, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def animated_bytes(fmt: str = "GIF", n_frames: int = 6, size: tuple[int, int] = (32, 24),
                   duration_ms: int = 100) -> bytes:
    """An animation whose frame k is filled with ``frame_level(k)``."""
    frames = [Image.new("RGB", size, (frame_level(k),) * 3) for k in range(n_frames)]
    buf = io.BytesIO()
    frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:], duration=duration_ms,
                   loop=0)
    return buf.getvalue()


def audio_bytes(container: str = "wav", codec: str = "pcm_s16le", rate: int = 22050,
                seconds: float = 1.0, channels: int = 2, freq: float = 440.0) -> bytes:
    """A sine tone (same in every channel) encoded with PyAV."""
    buf = io.BytesIO()
    layout = "stereo" if channels == 2 else "mono"
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        fmt = stream.codec_context.codec.audio_formats[0].name
        n = int(rate * seconds)
        t = np.arange(n, dtype=np.float64) / rate
        wave = (0.5 * np.sin(2 * math.pi * freq * t)).astype(np.float32)
        chunk = stream.codec_context.frame_size or 1024
        for start in range(0, n, chunk):
            piece = np.repeat(wave[None, start:start + chunk], channels, axis=0)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(piece), format="fltp", layout=layout)
            frame.sample_rate = rate
            frame.pts = start
            for resampled in _to_format(frame, fmt, layout, rate):
                out.mux(stream.encode(resampled))
        out.mux(stream.encode(None))
    return buf.getvalue()


def many_channels_wav(channels: int, tone: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit PCM WAV with ``tone`` on channel 0, silence on the others (no channel mask: any count)."""
    pcm = np.zeros((len(tone), channels), dtype="<i2")
    pcm[:, 0] = np.round(tone * 32767).astype("<i2")
    body = pcm.tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    return (b"RIFF" + struct.pack("<I", 36 + len(body)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", len(body)) + body)


def _to_format(frame: av.AudioFrame, fmt: str, layout: str, rate: int) -> list[av.AudioFrame]:
    return av.AudioResampler(format=fmt, layout=layout, rate=rate).resample(frame) if fmt != "fltp" else [frame]


def video_bytes(container: str = "mp4", codec: str = "mpeg4", fps: int = 10, n_frames: int = 20,
                size: tuple[int, int] = (64, 48), gop: int = 5, with_audio: bool = False,
                bframes: int = 0) -> bytes:
    """A video whose frame k is filled with ``frame_level(k)`` (plus a small moving square so the
    encoder has motion to code); keyframe every ``gop`` frames. ``bframes``: MPEG-4 part 2's
    consecutive B-frames (x264 uses its own default, B-frames with a pyramid, whatever this says)."""
    buf = io.BytesIO()
    w, h = size
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.gop_size = gop
        stream.codec_context.options = {"g": str(gop), "bf": str(bframes)} if codec == "mpeg4" else {"g": str(gop)}
        astream = out.add_stream("aac", rate=16000, layout="mono") if with_audio else None
        for k in range(n_frames):
            img = np.full((h, w, 3), frame_level(k), dtype=np.uint8)
            x = (3 * k) % max(1, w - 8)
            img[2:10, x:x + 8] = 255
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = k
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
        if astream is not None:
            n = int(16000 * n_frames / fps)
            samples = (0.3 * np.sin(np.arange(n) / 10.0)).astype(np.float32)[None, :]
            for start in range(0, n, 1024):
                f = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]),
                                               format="fltp", layout="mono")
                f.sample_rate, f.pts = 16000, start
                out.mux(astream.encode(f))
            out.mux(astream.encode(None))
    return buf.getvalue()


class FrameCounter:
    """A decode control that counts the frames a decoder produced (``check`` runs once per frame)."""

    def __init__(self) -> None:
        self.frames = 0

    def check(self) -> None:
        self.frames += 1


def tiny_flac(rate: int, block: int = 65535, frames: int = 2, value: int = 0) -> bytes:
    """A FLAC of ``frames`` blocks of ``block`` constant 8-bit mono samples at ``rate`` Hz, written
    by hand (FFmpeg's encoder takes no such rate) and a few dozen bytes long: its STREAMINFO
    declares no total, so no duration is known before decoding."""
    def crc(data: bytes, bits: int, poly: int) -> int:
        c, top, mask = 0, 1 << (bits - 1), (1 << bits) - 1
        for byte in data:
            c ^= byte << (bits - 8)
            for _ in range(8):
                c = ((c << 1) ^ poly) & mask if c & top else (c << 1) & mask
        return c

    info = struct.pack(">HH", block, block) + bytes(6)  # block sizes; frame sizes unknown
    info += ((rate << 44) | (7 << 36)).to_bytes(8, "big") + bytes(16)  # rate, mono, 8 bits, 0 samples; no MD5
    out = bytearray(b"fLaC\x80\x00\x00\x22" + info)
    for i in range(frames):  # frame number < 128: one byte of its UTF-8-like coding
        head = bytes([0xFF, 0xF8, 0x70, 0x00, i]) + struct.pack(">H", block - 1)  # rate, bits from STREAMINFO
        frame = head + bytes([crc(head, 8, 0x07), 0x00, value & 0xFF])  # one CONSTANT subframe
        out += frame + struct.pack(">H", crc(frame, 16, 0x8005))
    return bytes(out)
