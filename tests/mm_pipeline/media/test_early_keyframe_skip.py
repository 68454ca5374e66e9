"""The early decoder decodes only from the keyframe before each kept frame (``early_packets.KeyframeSkip``).

What is proven: on any in-order packet sequence the decoded packets are exactly, in order, the spans
from each kept frame's keyframe to it (nothing else, nothing missing); a pts out of order before any
drop turns the skip off (everything from there is decoded), after a drop it ends the decode; held
packets are released past ``MAX_HELD``; on a real moov-first MP4 without B-frames the early decoder
drops packets, still keeps every sampled frame, and its chunks equal the whole-bytes decode, while a
stream with B-frames (out of order from its first GOP) drops nothing and is decoded as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.media.decode.early import EarlyVideoDecode
from mm_pipeline.media.decode.early_packets import KeyframeSkip
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.decode.video_chunks import chunks_for_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.types import MediaItem, MediaKind
from samples.synthetic.throttled_http import remux_layout
from tests.support.arriving import early_chunks_match_whole, start_early
from tests.support.media_samples import video_bytes

SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)


@dataclass
class FakePacket:
    pts: int | None
    is_keyframe: bool
    size: int = 100


def _run(skip: KeyframeSkip, packets: list[FakePacket], need: list[bool]) -> tuple[list[int], bool]:
    """Feed every packet; (indices decoded, in order; whether the skip ended the decode)."""
    decoded: list[int] = []
    where = {id(p): i for i, p in enumerate(packets)}
    for p, n in zip(packets, need):
        batch = skip.feed(p, n)
        if batch is None:
            return decoded, True
        decoded += [where[id(q)] for q, _ in batch]
    return decoded, False


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=80))
def test_in_order_packets_decode_exactly_each_kept_frames_keyframe_span(spec: list[tuple[bool, bool]]) -> None:
    packets = [FakePacket(10 * i, key) for i, (key, _) in enumerate(spec)]
    need = [n for _, n in spec]
    skip = KeyframeSkip()
    decoded, ended = _run(skip, packets, need)
    assert not ended
    expected: set[int] = set()
    for i, n in enumerate(need):
        if n:
            start = max((k for k in range(i + 1) if packets[k].is_keyframe), default=0)
            expected.update(range(start, i + 1))
    assert decoded == sorted(expected)  # in decode order, each once
    # not decoded: dropped at a keyframe, or still held at the end (from the last keyframe after
    # the last kept frame, else right after it)
    last_needed = max((i for i, n in enumerate(need) if n), default=-1)
    keys_after = [k for k in range(last_needed + 1, len(packets)) if packets[k].is_keyframe]
    held_at_end = len(packets) - (keys_after[-1] if keys_after else last_needed + 1)
    assert skip.skipped == len(packets) - len(decoded) - held_at_end


def test_out_of_order_before_any_drop_turns_the_skip_off() -> None:
    # I0 P3 B1 B2 (B-frames: shown before the P demuxed before them), then a keyframe span
    packets = [FakePacket(0, True), FakePacket(30, False), FakePacket(10, False), FakePacket(20, False),
               FakePacket(40, True), FakePacket(50, False), FakePacket(60, True)]
    need = [True, False, False, False, False, False, True]
    skip = KeyframeSkip()
    decoded, ended = _run(skip, packets, need)
    assert not ended and decoded == list(range(7)) and skip.skipped == 0


def test_out_of_order_after_a_drop_ends_the_decode() -> None:
    packets = [FakePacket(0, True), FakePacket(10, False), FakePacket(20, True), FakePacket(40, False),
               FakePacket(30, False)]
    need = [True, False, True, False, False]
    skip = KeyframeSkip()
    decoded, ended = _run(skip, packets, need)
    assert ended and decoded == [0, 2] and skip.skipped == 1  # packet 1 dropped at the keyframe 2


def test_held_packets_are_released_past_the_cap_and_the_end_drains() -> None:
    skip = KeyframeSkip()
    skip.MAX_HELD = 3
    packets = [FakePacket(0, True)] + [FakePacket(10 * i, False) for i in range(1, 6)] + [FakePacket(None, False, 0)]
    decoded, ended = _run(skip, packets, [True] + [False] * 6)
    assert not ended and decoded == [0, 1, 2, 3, 4, 6] and skip.skipped == 0  # 5 still held; the drain passes


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    """10 fps, 120 frames, a keyframe every 10 (the sampling keeps every 5th frame, so the last 4 of
    each span are not needed); MPEG-4 without and with B-frames, moov-first MP4."""
    return {name: remux_layout(video_bytes("mp4", "mpeg4", fps=10, n_frames=120, size=(96, 64), gop=10,
                                           bframes=bframes), "index")
            for name, bframes in (("in-order", 0), ("b-frames", 2))}


def _early(data: bytes) -> tuple[EarlyVideoDecode, MediaItem]:
    early, _, sender = start_early(data, "index", SAMPLING, pause_s=0.002)
    sender.join()
    return early, MediaItem(MediaKind.VIDEO, "mp4", data, early=early)


@pytest.mark.parametrize("name", ["in-order", "b-frames"])
def test_early_decode_drops_span_tails_and_keeps_every_sampled_frame(clips, name: str) -> None:
    early, item = _early(clips[name])
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, SAMPLING)
    tp = 2
    chunks = plan_chunks(list(range(sampling.num_frames // tp)), sampling.indices, info.keyframes, tp, 2)
    assert early.join(10.0)
    assert chunks_for_early(early, info, sampling.indices, chunks, tp) == set(range(len(chunks)))
    used = early_chunks_match_whole(early, item, info, sampling.indices, chunks, tp, (32, 48))
    assert used == len(set(sampling.indices))  # every sampled frame came from the early decode
    if name == "in-order":
        # targets 0, 5, 10, ...: frames 6-9 of each span of 10 are never decoded
        assert early.skip.skipped >= 40, early.skip.skipped
        assert early.frames_decoded <= max(sampling.indices) + 1 - 40, early.frames_decoded
    else:
        assert early.skip.skipped == 0
