"""Decoding while the bytes arrive (media.decode.early, sniff.streamable_layout; the buffer itself:
test_arriving_bytes.py).

What is proven: the layout answer of each container; an early decode starts before the last byte and its
frames -- taken by production chunk by chunk, misses decoded as before -- equal the whole-bytes
decode for fragmented MP4, moov-first MP4 and Matroska; a body that fails mid-way or stalls ends
the decoder thread; a cancelled decode drops its frames.
"""

from __future__ import annotations

import threading
import time

import pytest

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.decode.early import EarlyDecoders, EarlyVideoDecode, chunks_for_early
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import streamable_layout
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.media.decode.video_chunks import plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from samples.synthetic.throttled_http import remux_layout
from tests.support.arriving import early_chunks_match_whole, feed
from tests.support.media_samples import image_bytes, video_bytes

SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    base = video_bytes("mp4", fps=10, n_frames=120, size=(96, 64), gop=10)
    return {layout: remux_layout(base, layout) for layout in ("fragments", "index", "matroska", "index-at-end")}


def test_streamable_layout(clips) -> None:
    for layout in ("fragments", "index", "matroska"):
        assert streamable_layout(clips[layout]) == layout
    assert streamable_layout(clips["index-at-end"]) == ""
    assert streamable_layout(clips["index"][:20]) is None  # moov not yet complete
    assert streamable_layout(image_bytes()) == ""
    assert streamable_layout(b"OggS" + bytes(20)) == "ogg"


# ---- early decode --------------------------------------------------------------------------------
def _early(data: bytes, layout: str, **feed_kw) -> tuple[EarlyVideoDecode, ArrivingBytes, threading.Thread]:
    body = ArrivingBytes(1 << 24, stall_s=5.0)
    sender = feed(body, data, **feed_kw)
    while body.received == 0:
        time.sleep(0.001)
    early = EarlyVideoDecode(body, layout, SAMPLING, max_kept_bytes=1 << 26, timeout_s=30.0)
    early.start()
    return early, body, sender


@pytest.mark.parametrize("layout", ["index", "matroska", "fragments"])
def test_early_frames_equal_whole_decode(clips, layout: str) -> None:
    data = clips[layout]
    early, body, sender = _early(data, layout, pause_s=0.02)  # the decoder keeps up with the sender
    sender.join()
    item = MediaItem(MediaKind.VIDEO, "mp4", data, early=early)
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, SAMPLING)
    tp, size = 2, (32, 48)
    chunks = plan_chunks(list(range(sampling.num_frames // tp)), sampling.indices, info.keyframes, tp, 2)
    assert early.join(10.0)
    if layout != "fragments":  # decoding started before the last byte
        assert early.received_at_first_frame is not None and early.received_at_first_frame < len(data)
    chosen = chunks_for_early(early, info, sampling.indices, chunks, tp)
    if layout == "fragments":  # no frame count up front: it decoded nothing, production decodes all
        assert early.prediction == "" and chosen == set()
        return
    assert chosen == set(range(len(chunks)))  # ended: every chunk takes its frames
    used = early_chunks_match_whole(early, item, info, sampling.indices, chunks, tp, size)
    assert used == len(set(sampling.indices)), early.prediction  # the count was known: every target kept


def test_body_failing_mid_way_ends_the_decoder(clips) -> None:
    data = clips["index"]
    early, body, sender = _early(data, "index", stop_at=len(data) // 2)
    sender.join()
    assert early.join(5.0) and early.ended
    stalled = ArrivingBytes(1 << 24, stall_s=0.3)
    stalled.feed(data[:len(data) // 3])  # a client that sends a third and then nothing
    early = EarlyVideoDecode(stalled, "index", SAMPLING, 1 << 26, timeout_s=30.0)
    early.start()
    assert early.join(5.0)


def test_cancel_and_slots(clips) -> None:
    data = clips["matroska"]
    decoders = EarlyDecoders(SAMPLING, MediaLimits(), fetch_timeout_s=5.0, limit=1)
    body = ArrivingBytes(1 << 24, stall_s=5.0)
    body.feed(data[:4096])
    first = decoders.start(body, "matroska")
    assert first is not None
    assert decoders.start(ArrivingBytes(1 << 24, stall_s=5.0), "matroska") is None  # no free slot
    first.cancel()
    body.fail()
    assert first.join(5.0)
    # no frame count up front: no thread at all
    assert decoders.start(ArrivingBytes(1 << 24, stall_s=5.0), "fragments") is None
    assert first.frames_until([0]) == {}
    again = decoders.start(ArrivingBytes(1 << 24, stall_s=0.2), "matroska")  # the slot came back
    assert again is not None and again.join(5.0)
