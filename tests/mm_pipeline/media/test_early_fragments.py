"""Fragmented MP4 decoded while it arrives, and early frames in the server's DecodeBudget
(media.decode.early, sniff.fragments_duration; issue 16 item 4).

What is proven: what FFmpeg-written fragmented MP4 states up front (no duration with
``frag_keyframe+empty_moov`` or ``frag_keyframe``; the whole duration with ``global_sidx``; a
per-fragment ``sidx`` is not taken for the whole; a ``mehd`` is read); with a stated duration the
early decode predicts the count and its frames, taken chunk by chunk, equal the whole-bytes decode;
a wrong duration stops the decoder past its prediction and the frames are still equal; concurrent
early decodes never hold more than the budget's early share, and give every byte back.
"""

from __future__ import annotations

import io
import time

import av
import pytest

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.budget import DecodeBudget
from mm_pipeline.media.decode.early import EarlyDecoders, EarlyVideoDecode
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.decode.video_chunks import chunks_for_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import fragments_duration, streamable_layout
from mm_pipeline.media.types import MediaItem, MediaKind
from tests.support.arriving import early_chunks_match_whole, feed, remux
from tests.support.media_samples import video_bytes

SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)


def _with_mehd(data: bytes, seconds: float) -> bytes:
    """``data`` (empty moov, default-base-moof: fragment offsets are moof-relative) with a ``mehd``
    stating ``seconds`` in its mvex, as Bento4/GPAC write it (mvhd timescale 1000 here)."""
    moov, mvex = data.index(b"moov") - 4, data.index(b"mvex") - 4
    mehd = (16).to_bytes(4, "big") + b"mehd" + bytes(4) + round(seconds * 1000).to_bytes(4, "big")

    def grown(at: int) -> bytes:
        return (int.from_bytes(data[at:at + 4], "big") + len(mehd)).to_bytes(4, "big")
    return (data[:moov] + grown(moov) + data[moov + 4:mvex] + grown(mvex) + data[mvex + 4:mvex + 8]
            + mehd + data[mvex + 8:])


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    base = video_bytes("mp4", fps=10, n_frames=120, size=(96, 64), gop=10)  # 12 s
    plain = remux(base, "mp4", "frag_keyframe+empty_moov+default_base_moof")
    return {
        "empty_moov": plain,
        "first_fragment_in_moov": remux(base, "mp4", "frag_keyframe"),
        # FFmpeg's global_sidx with absolute fragment offsets writes a file that does not decode
        "sidx_empty_moov": remux(base, "mp4", "frag_keyframe+empty_moov+global_sidx+default_base_moof"),
        "sidx": remux(base, "mp4", "frag_keyframe+global_sidx+default_base_moof"),
        "dash": remux(base, "mp4", "dash+frag_keyframe+empty_moov"),
        "mehd": _with_mehd(plain, 12.0),
        "mehd_wrong": _with_mehd(plain, 6.0),  # half the real length
    }


def test_what_ffmpeg_fragments_state_up_front(clips) -> None:
    for name, data in clips.items():
        assert streamable_layout(data) == "fragments", name
    stated = {name: fragments_duration(data[:1 << 20]) for name, data in clips.items()}
    assert stated == {"empty_moov": None, "first_fragment_in_moov": None, "sidx_empty_moov": 12.0, "sidx": 12.0,
                      "dash": None, "mehd": 12.0, "mehd_wrong": 6.0}
    with av.open(io.BytesIO(clips["mehd"])) as container:  # the box we add leaves the file readable
        assert sum(1 for _ in container.decode(video=0)) == 120


@pytest.mark.parametrize("name", ["sidx_empty_moov", "sidx", "mehd", "mehd_wrong"])
def test_fragments_with_a_duration_decode_early(clips, name: str) -> None:
    data = clips[name]
    body = ArrivingBytes(1 << 24, stall_s=5.0)
    sender = feed(body, data, pause_s=0.01)
    while streamable_layout(body.head(1 << 20)) is None:
        time.sleep(0.002)
    decoders = EarlyDecoders(SAMPLING, MediaLimits(), fetch_timeout_s=10.0)
    early = decoders.start(body, "fragments", MediaKind.VIDEO)
    assert isinstance(early, EarlyVideoDecode)
    sender.join()
    assert early.join(10.0) and early.prediction == "fragments"
    assert early.received_at_first_frame is not None and early.received_at_first_frame < len(data)
    item = MediaItem(MediaKind.VIDEO, "mp4", data, early=early)
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, SAMPLING)
    tp, size = 2, (32, 48)
    chunks = plan_chunks(list(range(sampling.num_frames // tp)), sampling.indices, info.keyframes, tp, 2)
    if name == "mehd_wrong":  # predicted 60 of 120 frames: it stopped past those, not at the end
        assert early.last_pts is not None and early.last_pts < info.pts[-1]
    assert chunks_for_early(early, info, sampling.indices, chunks, tp) == set(range(len(chunks)))
    used = early_chunks_match_whole(early, item, info, sampling.indices, chunks, tp, size)
    if name != "mehd_wrong":
        assert used == len(set(sampling.indices))  # the count was right: every target kept


def test_early_frames_are_held_in_the_decode_budget(clips) -> None:
    data = clips["sidx_empty_moov"]
    frame = 96 * 64 * 3 // 2
    budget = DecodeBudget(12 * frame)  # early share: 6 frames for all decodes together
    decoders = EarlyDecoders(SAMPLING, MediaLimits(), fetch_timeout_s=10.0, limit=4, budget=budget)
    bodies = [ArrivingBytes(1 << 24, stall_s=5.0) for _ in range(4)]
    senders = [feed(body, data, pause_s=0.002) for body in bodies]
    for body in bodies:
        while streamable_layout(body.head(1 << 20)) is None:
            time.sleep(0.002)
    earlies = [decoders.start(body, "fragments", None) for body in bodies]
    assert all(isinstance(e, EarlyVideoDecode) for e in earlies)
    peak = 0
    while not all(e.ended for e in earlies):
        peak = max(peak, budget.early_in_use)
        budget.check_integrity()
        time.sleep(0.001)
    for sender in senders:
        sender.join()
    assert 0 < budget.early_in_use <= budget.early_capacity and peak <= budget.early_capacity
    kept = sum(len(e.frames_until([0])) for e in earlies)  # taking a frame hands its bytes over
    assert kept <= 6
    for e in earlies:
        e.cancel()
    assert budget.in_use == 0 and budget.early_in_use == 0
    budget.check_integrity()
