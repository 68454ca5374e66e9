"""Decode work bounded by construction (issue 22): the per-item deadline and cancellation checked
per frame, the decoded-bytes budget shared by concurrent decodes, decoders that scale in uint8
(video frames at the planned size, large stills shrunk before any float copy), animations
decoded in one forward pass with their compositing work bounded from the header, audio that stops
at the context limit, regular files only, and text refused before it is tokenized whole."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import GifImagePlugin, Image

from mm_pipeline.errors import ContextLengthError, InvalidMediaError, MediaTooLarge
from mm_pipeline.media.decode.audio import decode_audio
from mm_pipeline.media.decode.budget import DecodeBudget, DecodeCancelled, DecodeControl, MediaDecodeTimeout
from mm_pipeline.media.decode.image import decode_animation_frames, decode_image, probe_animation, probe_image
from mm_pipeline.media.decode.video import decode_range, probe_video
from mm_pipeline.media.ingest import IngestConfig, MediaIngestor
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind, MediaSource
from mm_pipeline.prompt.text_bound import TextBound
from samples.synthetic.hostile_media import pixel_frames_gif
from tests.support.media_samples import animated_bytes, audio_bytes, frame_level, image_bytes, video_bytes


# ---- DecodeControl and DecodeBudget ----------------------------------------------------------------
def test_control_deadline_cancel_and_wanted():
    control = DecodeControl(0.05)
    control.check()
    time.sleep(0.06)
    with pytest.raises(MediaDecodeTimeout, match="decode_timeout_s"):
        control.check()
    control = DecodeControl(10)
    control.cancel()
    with pytest.raises(DecodeCancelled):
        control.check()
    wanted = [True]
    control = DecodeControl(10, wanted=lambda: wanted[0], poll_s=0)
    control.check()
    wanted[0] = False
    with pytest.raises(DecodeCancelled, match="no request wants it"):
        control.check()


def test_budget_never_holds_more_than_its_capacity():
    budget = DecodeBudget(100)
    with pytest.raises(MediaTooLarge, match="max_decoded_bytes_in_flight"):
        with budget.reserve(101):
            pass
    held, peak, lock = [0], [0], threading.Lock()

    def decode(n: int) -> None:
        with budget.reserve(n, DecodeControl(10)):
            with lock:
                held[0] += n
                peak[0] = max(peak[0], held[0])
            time.sleep(0.01)
            with lock:
                held[0] -= n

    threads = [threading.Thread(target=decode, args=(30 + k % 40,)) for k in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert 0 < peak[0] <= 100 and budget.in_use == 0
    budget.check_integrity()


def test_budget_wait_ends_at_the_deadline():
    budget = DecodeBudget(100)
    with budget.reserve(80):
        start = time.monotonic()
        with pytest.raises(MediaDecodeTimeout):
            with budget.reserve(40, DecodeControl(0.2)):
                pass
        assert time.monotonic() - start < 2
    assert budget.in_use == 0


# ---- decoders scale in uint8 --------------------------------------------------------------------
def test_video_frames_leave_the_decoder_at_the_planned_size():
    item = MediaItem(MediaKind.VIDEO, "mp4", video_bytes(n_frames=12, size=(64, 48), gop=4))
    info = probe_video(item)
    frames = decode_range(item, info, [1, 5, 9], size=(32, 16))
    assert frames.shape == (3, 32, 16, 3)
    levels = frames[:, 20:, 12:].float().mean(dim=(1, 2, 3))  # away from the moving square
    assert all(abs(float(v) - frame_level(k)) < 6 for v, k in zip(levels, [1, 5, 9]))


def test_decode_stops_at_the_next_frame_once_cancelled():
    item = MediaItem(MediaKind.VIDEO, "mp4", video_bytes(n_frames=20, gop=20))
    info = probe_video(item)
    control = DecodeControl(10)
    control.cancel()
    with pytest.raises(DecodeCancelled):
        decode_range(item, info, list(range(20)), control=control)


def test_large_image_is_shrunk_in_uint8_and_keeps_its_orientation():
    img = Image.fromarray(np.tile(np.arange(0, 250, dtype=np.uint8)[None, :, None], (400, 1, 3)).repeat(4, 1))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: shown rotated 90° clockwise
    buf = io.BytesIO()
    img.save(buf, format="PNG", exif=exif)
    item = MediaItem(MediaKind.IMAGE, "png", buf.getvalue())
    assert probe_image(item) == (1000, 400)  # (h, w) as shown
    full = decode_image(item).pixels
    small = decode_image(item, target=lambda h, w: (h // 8, w // 8)).pixels
    assert full.shape == (1000, 400, 3) and small.shape == (125, 50, 3)
    # the gradient runs down the shown image in both: same orientation
    assert small[0, 0, 0] < small[-1, 0, 0] and full[0, 0, 0] < full[-1, 0, 0]


# ---- animations -----------------------------------------------------------------------------------
def test_animation_compositing_work_is_bounded_from_the_header():
    item = MediaItem(MediaKind.VIDEO, "gif", pixel_frames_gif(300, 4096))
    start = time.monotonic()
    with pytest.raises(MediaTooLarge, match="max_animation_pixels"):
        probe_animation(item)
    assert time.monotonic() - start < 1
    small = MediaItem(MediaKind.VIDEO, "gif", pixel_frames_gif(20, 64))
    assert probe_animation(small).num_frames == 20
    # a frame past the logical screen grows the canvas mid-animation: bounded as it grows
    growing = MediaItem(MediaKind.VIDEO, "gif", pixel_frames_gif(300, 4096, screen=2))
    with pytest.raises(MediaTooLarge, match="grow"):
        probe_animation(growing)
    with pytest.raises(MediaTooLarge, match="grows the canvas"):
        decode_animation_frames(growing, [0, 1, 2], MediaLimits(max_pixels=1 << 20))


def test_animation_frames_come_from_one_forward_pass(monkeypatch):
    item = MediaItem(MediaKind.VIDEO, "gif", animated_bytes("GIF", n_frames=8, size=(32, 24)))
    seeks: list[int] = []
    original = GifImagePlugin.GifImageFile.seek
    monkeypatch.setattr(GifImagePlugin.GifImageFile, "seek",
                        lambda self, frame: (seeks.append(frame), original(self, frame))[1])
    frames = decode_animation_frames(item, [1, 3, 3, 6], size=(12, 16))
    assert frames.shape == (4, 12, 16, 3)
    assert seeks == [1, 3, 6]  # ascending, each needed frame once, never back to frame 0
    assert [abs(int(frames[k, 6, 8, 0]) - frame_level(i)) <= 2 for k, i in enumerate([1, 3, 3, 6])] == [True] * 4
    with pytest.raises(ValueError, match="ascending"):
        decode_animation_frames(item, [3, 1])


# ---- audio stops at the context limit ----------------------------------------------------------------
def test_audio_decoding_stops_at_the_context_limit():
    item = MediaItem(MediaKind.AUDIO, "wav", audio_bytes(seconds=4.0, rate=16000))
    assert decode_audio(item, 16000, context_samples=80_000).samples.shape[0] == 64_000
    with pytest.raises(ContextLengthError, match="longer than the model's context"):
        decode_audio(item, 16000, context_samples=16_000)


# ---- regular files only -------------------------------------------------------------------------------
def test_fifo_and_devices_are_refused_without_opening(tmp_path: Path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    ingestor = MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path), "/dev")))
    start = time.monotonic()
    for path in (str(fifo), "/dev/zero"):
        with pytest.raises(InvalidMediaError, match="not a regular file"):
            ingestor.ingest_local(MediaSource(path=path))
    assert time.monotonic() - start < 1
    (tmp_path / "ok.png").write_bytes(image_bytes())
    assert ingestor.ingest_local(MediaSource(path=str(tmp_path / "ok.png"))).format == "png"


def test_limits_validate_every_new_field():
    for name in ("max_media_items", "max_request_decoded_bytes", "max_decoded_bytes_in_flight",
                 "max_animation_pixels", "decode_timeout_s"):
        with pytest.raises(ValueError, match=name):
            MediaLimits(**{name: 0})


# ---- text bounded before tokenization -------------------------------------------------------------------
class CountingTokenizer:
    """One token per character; counts the characters it was asked to tokenize."""

    def __init__(self) -> None:
        self.chars = 0

    def get_vocab(self) -> dict[str, int]:
        return {"abcd": 0, "a": 1}  # at most 4 characters per token

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.chars += len(text)
        return [1] * len(text)


def test_text_bound_refuses_without_tokenizing_the_whole_text():
    tok = CountingTokenizer()
    bound = TextBound(tok)
    with pytest.raises(ContextLengthError, match="characters"):
        bound.check(["x" * 10_000_000], max_tokens=1000)  # > 4 chars per token: no tokenization at all
    assert tok.chars == 0
    with pytest.raises(ContextLengthError, match="stopped counting"):
        bound.check(["x " * 1500], max_tokens=1000)  # could fit by length: counted, stopped
    assert tok.chars <= 3000
    tok.chars = 0
    bound.check(["short"], max_tokens=1000)
    assert tok.chars == 0  # surely fits: not counted twice
    bound.check(["y" * 900], max_tokens=1000)  # counted, fits
