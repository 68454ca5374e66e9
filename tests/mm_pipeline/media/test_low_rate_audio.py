"""Audio at very low sample rates (media.decode.audio MIN_INPUT_RATE, and each frame's resampled size
checked against the limits before it is resampled), on both decode paths: the whole bytes and bytes
still arriving (media.decode.early_audio runs the same loop).

A FLAC block holds up to 65,535 samples and its header may declare no length: at 100 Hz one block
resampled to 24 kHz is 15.7 M samples, allocated whole (and copied twice) before the duration and
context checks, which ran only after a frame's output existed; at 10 Hz, GBs from 78 bytes.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Callable, TypeVar

import pytest

from mm_pipeline.errors import ContextLengthError, MediaTooLarge, UnsupportedMediaType
from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.audio import decode_audio, header_seconds
from mm_pipeline.media.decode.budget import DecodeBudget, DecodeControl
from mm_pipeline.media.decode.early_audio import EarlyAudioDecode
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.server.errors import http_answer
from tests.support.arriving import feed
from tests.support.media_samples import tiny_flac

RATE = 24000  # the demo encoder's
FLOOR = 1000  # media.decode.audio.MIN_INPUT_RATE (a literal: the tests run against code without it too)
T = TypeVar("T")


def _flac(rate: int, frames: int = 2, block: int = 65535) -> MediaItem:
    return MediaItem(MediaKind.AUDIO, "flac", tiny_flac(rate, block, frames))


def _peak(fn: Callable[[], T]) -> tuple[T | BaseException, int, float]:
    """``fn()``'s result or the exception it raised, the peak of Python/numpy allocations while it
    ran (every thread) and its seconds."""
    tracemalloc.start()
    t = time.perf_counter()
    try:
        got: T | BaseException = fn()
    except Exception as exc:
        got = exc
    took = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return got, peak, took


def test_audio_below_the_rate_floor_is_refused_before_anything_is_resampled() -> None:
    """100 Hz: the old code allocated a 63 MB chunk (and more in FFmpeg) before its context check."""
    item = _flac(100)
    assert header_seconds(item) is None  # nothing to reserve from: the decode must bound itself
    got, peak, took = _peak(lambda: decode_audio(item, RATE, MediaLimits(), DecodeControl(30.0, what="audio"),
                                                 context_samples=RATE * 60))
    assert isinstance(got, UnsupportedMediaType) and "100 Hz" in str(got), got
    assert http_answer(type(got)).status == 415
    assert peak < 4 << 20, f"{peak >> 20} MiB allocated"
    assert took < 2.0


@pytest.mark.parametrize(("limits", "context", "error"), [
    (MediaLimits(), RATE, ContextLengthError),  # 1 s of context; one block resamples to 65.5 s
    (MediaLimits(max_duration_s=1.0), None, MediaTooLarge),
])
def test_a_frame_that_would_resample_past_a_limit_is_refused_before_it_is(limits: MediaLimits, context: int | None,
                                                                          error: type) -> None:
    """At the floor, one 65,535-sample block still resamples to 1.6 M samples: refused by its size,
    the same error as counted samples give, before it is resampled (the old code held 6 MiB)."""
    got, peak, _ = _peak(lambda: decode_audio(_flac(FLOOR), RATE, limits, context_samples=context))
    assert type(got) is error, got
    assert peak < 2 << 20, f"{peak >> 20} MiB allocated"


def test_the_floor_itself_and_short_blocks_decode() -> None:
    audio = decode_audio(_flac(FLOOR, frames=3, block=4096), RATE)
    assert audio.samples.numel() == 3 * 4096 * RATE // FLOOR


def _early(data: bytes, context: int | None) -> EarlyAudioDecode:
    body = ArrivingBytes(1 << 20, stall_s=5.0)
    early = EarlyAudioDecode(body, RATE, MediaLimits(), context, timeout_s=10.0, budget=DecodeBudget(1 << 30),
                             reading=(False, False))
    early.start()
    feed(body, data, chunk=16).join()
    assert early.join(10.0)  # its allocations happened while traced
    return early


def test_the_early_decode_checks_the_same_way() -> None:
    """Bytes still arriving run the same loop: the block past the context is refused unresampled
    with the whole bytes' error; below the floor the early decode gives up and the whole bytes
    are refused."""
    item = _flac(FLOOR)
    early, peak, _ = _peak(lambda: _early(item.data, context=RATE))
    assert isinstance(early, EarlyAudioDecode)
    with pytest.raises(ContextLengthError):
        early.result(item, None)
    assert early.held == 0 and peak < 2 << 20, f"{peak >> 20} MiB allocated"
    low = _flac(100)
    early, peak, _ = _peak(lambda: _early(low.data, context=RATE * 60))
    assert isinstance(early, EarlyAudioDecode) and early.result(low, None) is None
    assert early.held == 0 and peak < 4 << 20, f"{peak >> 20} MiB allocated"
    with pytest.raises(UnsupportedMediaType):  # what the whole bytes then say
        decode_audio(low, RATE, context_samples=RATE * 60)
