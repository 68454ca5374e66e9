"""mm_pipeline decoders of still images and sound: image normalisation (orientation, alpha, palettes,
CMYK, 16-bit and gray modes, animations, pixel limits) and audio decoding and resampling."""

from __future__ import annotations

import io
import math
import struct

import numpy as np
import pytest
import torch
from tests.support.media_samples import (animated_bytes, audio_bytes, frame_level, image_bytes, many_channels_wav,
                                         video_bytes)
from PIL import Image

from mm_pipeline.media.decode.audio import decode_audio
from mm_pipeline.media.decode.image import decode_image
from mm_pipeline.errors import MediaTooLarge, UndecodableMediaError
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.server.errors import http_answer


def _image(data: bytes, fmt: str = "png") -> MediaItem:
    return MediaItem(MediaKind.IMAGE, fmt, data)


def _png(img: Image.Image, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **save)
    return buf.getvalue()


# ---- images ---------------------------------------------------------------------------------

def test_exif_orientation_is_applied() -> None:
    rgb = np.full((20, 30, 3), 255, dtype=np.uint8)
    rgb[:5, :5] = (255, 0, 0)  # red mark top-left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    out = decode_image(_image(_png(Image.fromarray(rgb), exif=exif))).pixels.numpy()
    assert out.shape == (30, 20, 3)
    assert np.array_equal(out, np.rot90(rgb, k=-1))  # mark now top-right


def test_alpha_is_composited_on_white() -> None:
    rgba = np.zeros((2, 3, 4), dtype=np.uint8)
    rgba[..., :3] = (200, 100, 0)
    rgba[..., 3] = [[0, 255, 128], [64, 0, 255]]
    out = decode_image(_image(_png(Image.fromarray(rgba, "RGBA")))).pixels.numpy().astype(int)
    a = rgba[..., 3:4].astype(int)
    expect = (rgba[..., :3].astype(int) * a + 255 * (255 - a) + 127) // 255
    assert np.array_equal(out, expect)
    assert (out[0, 0] == 255).all()
    la = decode_image(_image(image_bytes("PNG", mode="LA"))).pixels
    assert torch.equal(la[..., 0], la[..., 1])


def test_palette_with_and_without_transparency() -> None:
    p = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4), "P")
    p.putpalette([v for i in range(256) for v in (i * 3 % 256, i * 5 % 256, i * 7 % 256)])
    plain = decode_image(_image(_png(p))).pixels.numpy()
    assert np.array_equal(plain, np.asarray(p.convert("RGB")))
    transparent = decode_image(_image(_png(p, transparency=5))).pixels.numpy()
    assert (transparent[1, 1] == 255).all()  # palette index 5 sits at row 1, col 1
    assert np.array_equal(np.delete(transparent.reshape(-1, 3), 5, 0), np.delete(plain.reshape(-1, 3), 5, 0))


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF"])
def test_cmyk_becomes_rgb(fmt: str) -> None:
    cmyk = Image.new("CMYK", (8, 8), (255, 0, 0, 0))  # pure cyan ink
    buf = io.BytesIO()
    cmyk.save(buf, format=fmt)
    out = decode_image(_image(buf.getvalue(), fmt.lower())).pixels.numpy().astype(int)
    assert np.abs(out - np.array([0, 255, 255])).max() <= 3


def test_sixteen_bit_gray_keeps_the_high_byte() -> None:
    gray = (np.arange(48 * 64).reshape(48, 64) * 21).astype(np.uint16)
    img = Image.fromarray(gray)
    assert img.mode.startswith("I;16")
    out = decode_image(_image(_png(img))).pixels.numpy()
    assert np.array_equal(out[..., 0], (gray >> 8).astype(np.uint8))
    assert np.array_equal(out[..., 0], out[..., 2])


@pytest.mark.parametrize("mode", ["L", "1"])
def test_gray_modes_become_rgb(mode: str) -> None:
    data = image_bytes("PNG", mode=mode)
    out = decode_image(_image(data)).pixels.numpy()
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("L"))
    assert all(np.array_equal(out[..., c], ref) for c in range(3))


def test_animated_gif_as_image_is_its_first_frame() -> None:
    out = decode_image(_image(animated_bytes("GIF"), "gif")).pixels
    assert (out.float() - frame_level(0)).abs().max() <= 2


def test_pixel_limit_before_decoding_and_damaged_image() -> None:
    data = image_bytes("PNG", size=(64, 48))
    with pytest.raises(MediaTooLarge, match="3072 pixels") as info:
        decode_image(_image(data), MediaLimits(max_pixels=3071))
    assert http_answer(type(info.value)).status == 413
    with pytest.raises(UndecodableMediaError) as info2:
        decode_image(_image(data[: len(data) // 2]))
    assert http_answer(type(info2.value)).status == 400


# ---- audio ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("container", "codec", "rate"), [
    ("wav", "pcm_s16le", 22050), ("flac", "flac", 44100), ("mp3", "libmp3lame", 44100),
    ("ogg", "libopus", 48000), ("mp4", "aac", 8000),
])
@pytest.mark.parametrize("target", [16000, 24000])
def test_audio_is_mono_float_at_the_requested_rate(container: str, codec: str, rate: int, target: int) -> None:
    item = MediaItem(MediaKind.AUDIO, container, audio_bytes(container, codec, rate=rate, seconds=1.0))
    out = decode_audio(item, target)
    s = out.samples.numpy()
    assert out.sample_rate == target and out.samples.dtype == torch.float32 and s.ndim == 1
    assert abs(out.duration_s - 1.0) < 0.08  # codec priming/padding only
    peak_hz = np.argmax(np.abs(np.fft.rfft(s))) * target / len(s)
    assert abs(peak_hz - 440) < 3
    assert 0.4 < np.abs(s[len(s) // 4: -len(s) // 4]).max() < 0.6


def test_audio_channels_are_averaged() -> None:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:  # left: tone, right: silence
        stream = out.add_stream("pcm_f32le", rate=16000, layout="stereo")
        tone = (0.8 * np.sin(np.arange(16000) * 2 * math.pi * 300 / 16000)).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(np.stack([tone, np.zeros_like(tone)]), format="fltp", layout="stereo")
        frame.sample_rate = 16000
        for f in av.AudioResampler(format="flt", layout="stereo", rate=16000).resample(frame):
            out.mux(stream.encode(f))
        out.mux(stream.encode(None))
    s = decode_audio(MediaItem(MediaKind.AUDIO, "wav", buf.getvalue()), 16000).samples.numpy()
    assert np.allclose(s, tone / 2, atol=1e-6)


@pytest.mark.parametrize("channels", [6, 8, 9, 64])
def test_audio_of_eight_and_more_channels_is_averaged_not_a_crash(tmp_path, channels: int) -> None:
    """An ordinary 7.1 track (8 channels) crashed the process: PyAV's planar ``to_ndarray`` read past
    FFmpeg's eight data pointers. Decoded in a child process, so a crash fails this test alone."""
    import subprocess
    import sys

    tone = 0.8 * np.sin(np.arange(8000) * 2 * math.pi * 300 / 16000)
    (tmp_path / "in.wav").write_bytes(many_channels_wav(channels, tone))
    script = ("import sys, numpy as np; from mm_pipeline.media.decode.audio import decode_audio; "
              "from mm_pipeline.media.types import MediaItem, MediaKind; "
              "item = MediaItem(MediaKind.AUDIO, 'wav', open(sys.argv[1], 'rb').read()); "
              "np.save(sys.argv[2], decode_audio(item, 16000).samples.numpy())")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.wav"), str(tmp_path / "out.npy")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    s = np.load(tmp_path / "out.npy")
    assert s.shape == tone.shape and np.allclose(s, tone / channels, atol=1e-4)


def test_audio_duration_limit_and_garbage() -> None:
    item = MediaItem(MediaKind.AUDIO, "wav", audio_bytes(seconds=2.0))
    with pytest.raises(MediaTooLarge, match="limit"):
        decode_audio(item, 16000, MediaLimits(max_duration_s=1.0))
    with pytest.raises(UndecodableMediaError):
        decode_audio(MediaItem(MediaKind.AUDIO, "wav", b"RIFF\x00\x00\x00\x00WAVEjunkjunk"), 16000)
    movie = MediaItem(MediaKind.AUDIO, "mp4", video_bytes(with_audio=True, n_frames=20, fps=10))
    assert abs(decode_audio(movie, 16000).duration_s - 2.0) < 0.1  # the audio track of a video


def test_audio_whose_rate_and_layout_change_midway_decodes_every_part() -> None:
    """Two AAC (ADTS) streams back to back (8 kHz mono, then 22.05 kHz stereo): the decoder's frames
    change rate and layout midway, which PyAV's resampler refuses (ValueError); both parts come out,
    at the requested rate, and a frame nothing can take is an UndecodableMediaError, never a bare
    ValueError (found by the media fuzz test)."""
    import av

    data = (audio_bytes("adts", "aac", rate=8000, seconds=0.5, channels=1)
            + audio_bytes("adts", "aac", rate=22050, seconds=0.5, channels=2))
    with av.open(io.BytesIO(data)) as c:
        setups = {(f.layout.name, f.sample_rate) for f in c.decode(audio=0)}
    assert setups == {("mono", 8000), ("stereo", 22050)}  # the premise: the frames change setup midway
    out = decode_audio(MediaItem(MediaKind.AUDIO, "aac", data), 16000)
    assert out.sample_rate == 16000 and 0.9 < out.duration_s < 1.4  # both parts (AAC priming included)


def _float_wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    """A WAVE_FORMAT_IEEE_FLOAT file (format 3, 32-bit), written by hand: it carries any float bit
    pattern, NaN and Inf included, as such files in the wild do."""
    data = np.ascontiguousarray(samples, dtype="<f4").tobytes()
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * 4 * channels, 4 * channels, 32)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["first", "last", "one channel"])
def test_float_audio_with_non_finite_samples_is_refused(bad: float, where: str) -> None:
    """A float WAV with a NaN / Inf sample is a bad-media error (HTTP 400) naming the problem, never
    samples handed to the encoder: its NaN would come out as NaN embeddings (and, before the encoder
    masked its gaps with masked_fill, leaked into other requests' audio in the same batch)."""
    rng = np.random.default_rng(0)
    clean = (0.1 * rng.standard_normal((16000 * 2, 2))).astype(np.float32)
    assert decode_audio(MediaItem(MediaKind.AUDIO, "wav", _float_wav(clean)), 16000).samples.isfinite().all()
    samples = clean.copy()
    if where == "first":
        samples[0, :] = bad
    elif where == "last":
        samples[-1, :] = bad
    else:
        samples[len(samples) // 2, 1] = bad  # one channel only: the channel average must not hide it
    with pytest.raises(UndecodableMediaError, match="non-finite samples") as info:
        decode_audio(MediaItem(MediaKind.AUDIO, "wav", _float_wav(samples)), 16000)
    assert http_answer(type(info.value)).status == 400
