"""Hostile media generated in memory for the limit tests and benchmarks (issue 22): files that are
tiny on the wire and huge, slow or endless once decoded. Never downloaded; each built in seconds.
``measured`` runs one request and reports its time and this process's peak RSS growth."""

from __future__ import annotations

import io
import struct
import time
import zlib
from pathlib import Path
from typing import Callable, TypeVar

import av
import numpy as np
from PIL import Image

T = TypeVar("T")


def huge_video(side: int = 8192, n_frames: int = 8, fps: int = 10) -> bytes:
    """An H.264 MP4 of ``n_frames`` flat frames of side x side (8192²: about 200 KB)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        stream.codec_context.options = {"preset": "ultrafast", "g": str(n_frames)}
        frame = av.VideoFrame.from_ndarray(np.full((side, side, 3), 90, np.uint8), format="rgb24")
        frame = frame.reformat(format="yuv420p")
        for k in range(n_frames):
            frame.pts = k
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def resizing_webm(big: int = 4096, n_frames: int = 8, small: int = 64, pix_fmt: str = "yuv420p",
                  codec: str = "libvpx") -> bytes:
    """A WebM (VP8; ``codec`` "libvpx-vp9" for other pixel formats) whose header and first keyframe
    say ``small``², every later keyframe ``big``²: the size check before decoding sees only the
    header. Solid frames compress to almost nothing: big=4096 with 20 frames is about 0.5 MB."""
    import fractions
    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as out:
        stream = out.add_stream(codec, rate=1)
        stream.width, stream.height, stream.pix_fmt = small, small, pix_fmt
        stream.time_base = fractions.Fraction(1, 1000)
        for k in range(n_frames):
            side = small if k == 0 else big
            enc = av.CodecContext.create(codec, "w")  # one encoder per size: a keyframe each
            enc.width, enc.height, enc.pix_fmt = side, side, pix_fmt
            enc.time_base = enc.framerate = fractions.Fraction(1, 1)
            enc.options = {"deadline": "realtime", "cpu-used": "8"}
            frame = av.VideoFrame.from_ndarray(np.full((side, side, 3), 40 + k, np.uint8), format="rgb24")
            frame = frame.reformat(format=pix_fmt)
            frame.pts, frame.time_base = 0, enc.time_base
            for packet in [*enc.encode(frame), *enc.encode(None)]:
                packet.stream, packet.pts, packet.dts, packet.time_base = stream, k * 1000, k * 1000, stream.time_base
                out.mux(packet)
    return buf.getvalue()


def png_frame_mov(side: int = 12000, with_audio: bool = False) -> bytes:
    """A MOV of one video frame: a side x side RGBA 16-bit PNG of zeros (8 B per decoded pixel;
    12000²: 1.1 GB decoded from a 2.2 MB file; 3000²: 72 MB from 70 KB), whose size only the
    frame itself carries -- FFmpeg's stream probe decodes it inside the open to learn it.
    ``with_audio``: a second stream, one second of 8 kHz silence (an audio item's container)."""
    from fractions import Fraction

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z = zlib.compressobj(9)
    row = bytes(1 + side * 8)  # filter byte, then RGBA at 16 bits
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 16, 6, 0, 0, 0))
           + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mov") as out:
        video = out.add_stream("png", rate=1)
        video.width, video.height, video.pix_fmt = side, side, "rgba64be"
        sound = out.add_stream("pcm_s16le", rate=8000, layout="mono") if with_audio else None
        packet = av.Packet(png)
        packet.stream, packet.pts, packet.dts, packet.time_base = video, 0, 0, Fraction(1, 1)
        out.mux(packet)
        if sound is not None:
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 8000), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = 8000, 0
            out.mux(sound.encode(frame))
            out.mux(sound.encode(None))
    return buf.getvalue()


def tiny_boxes_mp4(video: bytes, nbytes: int = 1 << 20) -> bytes:
    """``video`` (an MP4) with ``nbytes`` of 8-byte empty ``free`` boxes after its ``ftyp``: a head a
    reader walking the boxes to find the layout would walk 131,072 times for 1 MiB (the chunk
    offsets are not moved: the file need not decode, only be looked at while it arrives)."""
    ftyp = int.from_bytes(video[:4], "big")
    return video[:ftyp] + (bytes([0, 0, 0, 8]) + b"free") * (nbytes // 8) + video[ftyp:]


def pixel_frames_gif(n_frames: int = 300, canvas: int = 4096, screen: int | None = None) -> bytes:
    """A GIF with a canvas x canvas logical screen and ``n_frames`` frames of one pixel each (about
    7 KB for 300; every frame a decoder composites costs the whole canvas). Written by hand:
    PIL's encoder merges such frames. ``screen``: a smaller logical screen in the header, with the
    second frame at the canvas's far corner (decoders grow the canvas there)."""
    out = bytearray(b"GIF89a" + struct.pack("<HH", screen or canvas, screen or canvas) + bytes([0xF1, 0, 0]))
    out += bytes([0, 0, 0, 255, 255, 255, 255, 0, 0, 0, 0, 255])  # 4-colour global table
    for k in range(n_frames):
        out += bytes([0x21, 0xF9, 4, 0x04]) + struct.pack("<H", 4) + bytes([0, 0])  # 40 ms, keep frame
        x, y = (canvas - 1, canvas - 1) if screen is not None and k == 1 else (k % canvas, k // canvas)
        out += b"\x2c" + struct.pack("<HHHH", x, y, 1, 1) + b"\x00"
        code = 4 | ((1 + k % 3) << 3) | (5 << 6)  # LZW at 3 bits: clear, the pixel, end
        out += bytes([2, 2, code & 0xFF, code >> 8, 0])
    return bytes(out + b"\x3b")


def huge_png(side: int = 8192) -> bytes:
    """A flat side x side grayscale PNG (8192²: about 70 KB)."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 128).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def png_variant(png: bytes, seed: int) -> bytes:
    """``png`` with a tEXt chunk after its header: the same pixels, new content (a new hash)."""
    body = b"Comment\0" + str(seed).encode()
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    ihdr_end = 8 + 4 + 4 + 13 + 4  # signature, then IHDR: length, type, 13 bytes of data, CRC
    return png[:ihdr_end] + chunk + png[ihdr_end:]


def silent_flac(seconds: float = 3600.0, rate: int = 8000) -> bytes:
    """``seconds`` of digital silence as FLAC (an hour at 8 kHz: a few hundred KB)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout="mono")
        block = np.zeros((1, rate * 10), np.int16)
        for k in range(int(seconds // 10)):
            frame = av.AudioFrame.from_ndarray(block, format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, k * rate * 10
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def measured(send: Callable[[], T]) -> tuple[T, float, float]:
    """(``send()``'s result, seconds, growth of this process's peak RSS in MB): the peak (VmHWM)
    is reset to the current RSS first (``/proc/self/clear_refs``; Linux). Raises ``OSError`` where
    the peak cannot be reset."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    result = send()
    seconds = time.perf_counter() - start
    return result, seconds, (_status_kb("VmHWM") - before) / 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")
