"""The decode-while-arriving path drops what the sampled frames do not need, as ``decode_range`` does:
unkept frames no other frame is predicted from (H.264's B-pyramid, MPEG-4 part 2 B-frames) are not
decoded, whether the frames to keep are still the prediction (by presentation rank) or production has
named them (by pts), and every sampled frame is still kept and equals the whole-bytes decode."""

from __future__ import annotations

import io
import time

import av
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.early import EarlyVideoDecode
from mm_pipeline.media.decode.early_packets import PresentationRanks
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.decode.video_chunks import chunks_for_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.sniff import open_av
from mm_pipeline.media.types import MediaItem, MediaKind
from samples.synthetic.throttled_http import remux_layout
from tests.support.arriving import early_chunks_match_whole, start_early
from tests.support.media_samples import video_bytes

SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)
N_FRAMES = 120


@pytest.fixture(scope="module")
def clips() -> dict[tuple[str, str], bytes]:
    """10 fps, 120 frames, a keyframe every 30: x264 (B-pyramid) and MPEG-4 with 2 B-frames, as a
    moov-first MP4 and as Matroska."""
    out = {}
    for codec, bframes in (("libx264", 0), ("mpeg4", 2)):
        base = video_bytes("mp4", codec, fps=10, n_frames=N_FRAMES, size=(96, 64), gop=30, bframes=bframes)
        for layout in ("index", "matroska"):
            out[codec, layout] = remux_layout(base, layout)
    return out


def _plan(item: MediaItem):
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, SAMPLING)
    tp = 2
    chunks = plan_chunks(list(range(sampling.num_frames // tp)), sampling.indices, info.keyframes, tp, 2)
    return info, sampling.indices, chunks, tp


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
@pytest.mark.parametrize(("layout", "threads"), [("index", 1), ("matroska", 1), ("index", 0)])
def test_predicted_frames_are_kept_while_unkept_nonreference_frames_are_dropped(clips, codec: str, layout: str,
                                                                                threads: int) -> None:
    """The whole video decoded early under the header's prediction: every sampled frame is kept
    (a packet's rank among the pts demuxed so far named it right), the chunks equal the whole-bytes
    decode, and fewer frames came out of the decoder than the video has before its last target --
    with FFmpeg's frame threads too (``threads`` 0: each packet's setting travels with it)."""
    data = clips[codec, layout]
    early, body, sender = start_early(data, layout, SAMPLING, threads, pause_s=0.004)
    sender.join()
    item = MediaItem(MediaKind.VIDEO, "mp4", data, early=early)
    info, indices, chunks, tp = _plan(item)
    assert early.join(10.0)
    assert chunks_for_early(early, info, indices, chunks, tp) == set(range(len(chunks)))
    used = early_chunks_match_whole(early, item, info, indices, chunks, tp, (32, 48))
    assert used == len(set(indices)), (codec, layout, early.prediction)
    # up to the last target (frame 119): x264 77 (MP4) / 95 (Matroska: a few frame counts kept) of
    # 120 frames decoded; MPEG-4 56 / 83
    assert early.frames_decoded <= max(indices) + 1 - 20, early.frames_decoded


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_frames_named_by_production_mid_decode_are_kept_by_pts(clips, codec: str) -> None:
    """Production names its frames (``retarget``) while the bytes still arrive: from then on the
    decoder keeps and decodes by those pts -- every chunk it serves equals the whole-bytes decode,
    and it still skips unnamed non-reference frames."""
    data = clips[codec, "index"]
    body = ArrivingBytes(1 << 24, stall_s=30.0)
    cut = len(data) * 7 // 10  # the rest only after production named its frames
    body.feed(data[:cut])
    early = EarlyVideoDecode(body, "index", SAMPLING, max_kept_bytes=1 << 26, timeout_s=30.0)
    early.start()
    deadline = time.monotonic() + 10.0
    while early.frames_decoded < 12 and time.monotonic() < deadline:
        time.sleep(0.002)
    item = MediaItem(MediaKind.VIDEO, "mp4", data, early=early)
    info, indices, chunks, tp = _plan(item)  # (the test has the whole bytes; a server waits for them)
    chosen = chunks_for_early(early, info, indices, chunks, tp)
    assert not early.ended
    body.feed(data[cut:])
    body.finish()
    assert early.join(10.0)
    served = [chunks[c] for c in sorted(chosen)]
    early_chunks_match_whole(early, item, info, indices, served, tp, (32, 48))
    assert served  # (it had reached the first chunks' seek points)
    last = max(indices[g * tp + tp - 1] for groups in served for g in groups)
    assert early.frames_decoded < last + 1  # x264: 56 frames decoded up to frame 87; MPEG-4: 37 up to 77


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(list(range(12))))
def test_presentation_ranks_of_decoded_frames_are_exact(order: list[int]) -> None:
    """Whatever the decode order, a frame's rank once every frame shown before it was demuxed (as
    when a decoder hands it out) is its presentation index; a packet's rank at demux never exceeds it."""
    ranks = PresentationRanks()
    pts = [10 * k + 3 for k in order]
    for p in pts:
        assert ranks.add(p) <= (p - 3) // 10
    assert [ranks.rank(10 * k + 3) for k in range(12)] == list(range(12))


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_packet_ranks_name_every_frame_right_for_b_frame_encoders(clips, codec: str) -> None:
    """In the decode order x264's pyramid and MPEG-4's B-frames are written in, a packet's rank at
    demux is its presentation index for every frame that is not a reference (the only ones whose
    decoding the rank decides)."""
    with open_av(clips[codec, "index"]) as container:
        stream = container.streams.video[0]
        ranks = PresentationRanks()
        at_demux = {p.pts: ranks.add(p.pts) for p in container.demux(stream) if p.pts is not None}
    order = sorted(at_demux)
    exact = {p: k for k, p in enumerate(order)}
    wrong = [p for p in order if at_demux[p] != exact[p]]
    # the frames whose demux rank is low are exactly the ones shown after a later-demuxed frame: the
    # references a B-frame is predicted from (never dropped, so a low rank costs nothing)
    assert len(wrong) < len(order) // 2
    with av.open(io.BytesIO(clips[codec, "index"])) as container:
        stream = container.streams.video[0]
        stream.codec_context.skip_frame = "NONREF"
        decoded_refs = {f.pts for f in container.decode(stream)}
    assert set(wrong) <= decoded_refs
