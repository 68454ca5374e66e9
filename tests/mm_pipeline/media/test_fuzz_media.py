"""Fuzz target for the sniffer and every decoder (issue 22): mutated bytes of each supported format
(byte flips, overwritten runs, truncation, insertion, duplicated spans) and random bytes behind
each format's magic go through sniff -> probe -> decode as the pipeline would run them. Whatever
comes in, the only exceptions allowed out are ``MediaError`` subclasses, each example finishes in
bounded time (the decode deadline plus slack) and the whole run stays within a memory bound.

Bounded in CI; for a longer local run: ``MMSERVE_FUZZ_EXAMPLES=5000 pytest tests/mm_pipeline/media/test_fuzz_media.py``.
"""

from __future__ import annotations

import functools
import io
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mm_pipeline.errors import MediaError
from mm_pipeline.media.decode.audio import decode_audio
from mm_pipeline.media.decode.budget import DecodeControl
from mm_pipeline.media.decode.image import decode_animation_frames, decode_image, probe_animation, probe_image
from mm_pipeline.media.decode.video import decode_range, probe_video
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import sniff
from mm_pipeline.media.types import MediaItem, MediaKind
from tests.support.media_samples import animated_bytes, audio_bytes, image_bytes, video_bytes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PIL on corrupt EXIF: expected here

EXAMPLES = int(os.environ.get("MMSERVE_FUZZ_EXAMPLES", "150"))
DEADLINE_S = 5.0
LIMITS = MediaLimits(max_pixels=1 << 22, max_duration_s=120.0, max_frames=5000, max_animation_pixels=1 << 26,
                     decode_timeout_s=DEADLINE_S)


@functools.cache
def seeds() -> dict[str, bytes]:
    """One small valid file per format the sniffer accepts."""
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 30)).save(buf, format="BMP")
    return {
        "png": image_bytes("PNG", mode="RGBA"), "jpeg": image_bytes("JPEG"), "tiff": image_bytes("TIFF"),
        "bmp": buf.getvalue(), "gif": animated_bytes("GIF", n_frames=4),
        "webp": animated_bytes("WEBP", n_frames=3), "wav": audio_bytes("wav", seconds=0.3),
        "flac": audio_bytes("flac", "flac", seconds=0.3), "mp3": audio_bytes("mp3", "libmp3lame", seconds=0.3),
        "ogg": audio_bytes("ogg", "libopus", rate=48000, seconds=0.3), "mp4": video_bytes(n_frames=8, gop=4),
        "mkv": video_bytes("matroska", n_frames=8, gop=4), "avi": video_bytes("avi", n_frames=6, gop=3),
    }


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 255)),
    st.tuples(st.just("overwrite"), st.floats(0, 1), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.none()),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=256)),
    st.tuples(st.just("repeat"), st.floats(0, 1), st.integers(1, 4096)),
)


def _mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for kind, where, arg in mutations:
        at = min(len(out) - 1, int(where * len(out))) if out else 0
        if kind == "flip" and out:
            out[at] ^= arg or 1
        elif kind == "overwrite":
            out[at:at + len(arg)] = arg
        elif kind == "truncate":
            del out[max(1, at):]
        elif kind == "insert":
            out[at:at] = arg
        elif kind == "repeat":
            out[at:at] = out[at:at + arg]
    return bytes(out)


def _run_pipeline(data: bytes) -> None:
    """sniff, then every kind the content can serve as, probed and decoded as the runtime does."""
    try:
        found = sniff(data)
    except MediaError:
        return
    for kind in sorted(found.kinds, key=lambda k: k.value):
        item = MediaItem(kind, found.format, data, origin="fuzz")
        control = DecodeControl(DEADLINE_S, what="fuzz input")
        try:
            if kind is MediaKind.IMAGE:
                probe_image(item, LIMITS)
                decode_image(item, LIMITS, target=lambda h, w: (max(1, h // 4), max(1, w // 4)))
            elif kind is MediaKind.AUDIO:
                decode_audio(item, 16000, LIMITS, control)
            elif found.format in ("gif", "webp"):
                anim = probe_animation(item, LIMITS, control)
                decode_animation_frames(item, sorted({0, anim.num_frames - 1}), LIMITS, (16, 16), control)
            else:
                info = probe_video(item, LIMITS, control)
                targets = sorted({0, info.total_frames // 2, info.total_frames - 1})
                decode_range(item, info, targets, size=(16, 16), control=control)
        except MediaError:
            pass


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def memory_bound():
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS")
    start = _peak_rss_mb()
    yield
    assert _peak_rss_mb() - start <= 512, "fuzzed decodes grew the peak RSS by more than 512 MB"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(seeds())), mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_media_raise_only_media_errors(memory_bound, name, mutations):
    start = time.monotonic()
    _run_pipeline(_mutate(seeds()[name], mutations))
    assert time.monotonic() - start < 3 * DEADLINE_S  # a probe, then a decode: each under the deadline


@settings(max_examples=max(20, EXAMPLES // 3), deadline=None)
@given(name=st.sampled_from(sorted(seeds())), tail=st.binary(max_size=2048))
def test_random_bytes_behind_a_magic_raise_only_media_errors(memory_bound, name, tail):
    start = time.monotonic()
    _run_pipeline(seeds()[name][:16] + tail)
    assert time.monotonic() - start < 3 * DEADLINE_S
