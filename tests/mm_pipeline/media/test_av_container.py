"""Opening media with PyAV (media.av_container): which video stream every stage decodes.

What is proven: FFmpeg's stream probe, which runs inside every open, decodes no frame over the
pixel limit -- a small MOV holding one frame over it is refused by the sniff and the video probe
with the pixel limit's 413 without decoding it, its audio is read without decoding it, and an open
past the item's deadline stops early. A container whose first video track has no decoder here is
decoded from the next track that has one -- by the sniff, the probe, the decode and the decode of
arriving bytes alike -- and one with no decodable video track is a 400 (415 at the sniff), never an
AttributeError (500).
"""

from __future__ import annotations

import io
import time

import av
import numpy as np
import pytest
import torch

from mm_pipeline.errors import MediaTooLarge, UndecodableMediaError, UnsupportedMediaType
from mm_pipeline.media.decode.audio import decode_audio, header_seconds
from mm_pipeline.media.decode.budget import DecodeControl, MediaDecodeTimeout
from mm_pipeline.media.decode.video import VideoDecoder, decode_range, probe_video
from mm_pipeline.media.decode.video_chunks import chunks_for_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.ingest import MediaIngestor
from mm_pipeline.media.ingest_config import IngestConfig, MediaLimits
from mm_pipeline.media.sniff import sniff
from mm_pipeline.media.types import MediaItem, MediaKind, MediaSource
from samples.synthetic.hostile_media import measured, png_frame_mov
from tests.support.arriving import early_chunks_match_whole, start_early

SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)
_CODEC_ID = b"V_MPEG4/ISO/ASP"


def _raised(call) -> Exception | None:
    try:
        call()
    except Exception as exc:
        return exc
    return None


# ---- the pixel limit inside the open --------------------------------------------------------------
@pytest.fixture(scope="module")
def png_mov() -> bytes:
    """87 KB: one 3000x3000 RGBA64 PNG frame (72 MB decoded; its stream probe took ~0.35 s and
    +68 MB of peak RSS in each open) and a second of silence."""
    return png_frame_mov(3000, with_audio=True)


def test_a_frame_over_the_pixel_limit_is_refused_without_decoding_it(png_mov: bytes) -> None:
    """Limit 1 M pixels: ingest sniffs the MOV as a video (its header states 3000x3000, so the
    probe, not the sniff, refuses it) and the probe answers the pixel limit's 413 naming the size
    -- neither decodes the frame (before: +68 MB and ~0.35 s in each of the two opens)."""
    limits = MediaLimits(max_pixels=1_000_000)
    ingestor = MediaIngestor(IngestConfig(limits=limits))
    item, seconds, grown_mb = measured(lambda: ingestor.ingest_local(MediaSource(data=png_mov, kind=MediaKind.VIDEO)))
    assert item.kind is MediaKind.VIDEO and grown_mb < 16, (seconds, grown_mb)  # memory, not time: a loaded host
    error, seconds, grown_mb = measured(lambda: _raised(lambda: probe_video(item, limits)))
    assert isinstance(error, MediaTooLarge) and "3000x3000 = 9000000 pixels, limit 1000000" in str(error)
    assert grown_mb < 16, (seconds, grown_mb)


def test_audio_is_read_without_decoding_the_video_track(png_mov: bytes) -> None:
    """The same MOV as an audio item: the audio decoders open it without decoding its video
    frame (their opens decode no video in the probe), whatever the pixel limit."""
    item = MediaItem(MediaKind.AUDIO, "mp4", png_mov)
    audio, seconds, grown_mb = measured(lambda: decode_audio(item, 16000))
    assert audio.samples.shape == (16000,) and grown_mb < 16, (seconds, grown_mb)
    claimed, seconds, grown_mb = measured(lambda: header_seconds(item))
    assert claimed == 1.0 and grown_mb < 16, (seconds, grown_mb)


def test_an_open_counts_against_the_items_deadline(png_mov: bytes) -> None:
    """Within the pixel limit the frame may be decoded, but not by an open that starts past the
    item's deadline: FFmpeg's probe stops reading and the probe raises the deadline's 413 (before:
    the open decoded the 72 MB frame first)."""
    control = DecodeControl(0.001, what="the video")
    time.sleep(0.01)
    error, seconds, grown_mb = measured(lambda: _raised(lambda: probe_video(
        MediaItem(MediaKind.VIDEO, "mp4", png_mov), MediaLimits(), control)))
    assert isinstance(error, MediaDecodeTimeout) and grown_mb < 16, (error, seconds, grown_mb)


# ---- which video stream ----------------------------------------------------------------------------
def two_track_mkv(unknown: int) -> bytes:
    """A Matroska file of two MPEG-4 video tracks, 64x48, 20 frames at 10 fps: track 0's frames
    are grey level 40, track 1's level 200; the CodecID of the first ``unknown`` tracks is
    rewritten to one no FFmpeg decoder takes (the auditor's patched file)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        streams = [out.add_stream("mpeg4", rate=10) for _ in range(2)]
        for s in streams:
            s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for k in range(20):
            for s, level in zip(streams, (40, 200)):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), level, np.uint8), format="rgb24")
                frame.pts = k
                for p in s.encode(frame):
                    out.mux(p)
        for s in streams:
            for p in s.encode():
                out.mux(p)
    data = buf.getvalue()
    at = 0
    for _ in range(unknown):
        at = data.index(_CODEC_ID, at)
        data = data[:at] + b"V_MPEG4/ISO/XYZ" + data[at + len(_CODEC_ID):]
    return data


def test_a_first_track_without_a_decoder_is_passed_over() -> None:
    """Track 0's codec is unknown here, track 1 decodes: the sniff counts a video, the probe and
    every decode take track 1 (its level-200 frames); before, the probe read track 0's missing
    codec context (AttributeError: a 500)."""
    data = two_track_mkv(unknown=1)
    found = sniff(data)
    assert found.primary is MediaKind.VIDEO
    item = MediaItem(MediaKind.VIDEO, found.format, data)
    info = probe_video(item)
    assert info.stream == 1 and (info.width, info.height) == (64, 48) and info.total_frames == 20
    frames = decode_range(item, info, [0, 10, 19])
    assert frames.shape == (3, 48, 64, 3) and abs(float(frames.float().mean()) - 200) < 8
    video = VideoDecoder(SAMPLING).decode_sync(item)
    assert abs(float(video.frames.float().mean()) - 200) < 8


def test_no_decodable_video_track_is_a_400() -> None:
    """Both tracks unknown: the sniff finds nothing it can serve (415) and the probe of the bytes
    as a video is an UndecodableMediaError (400) naming why."""
    data = two_track_mkv(unknown=2)
    with pytest.raises(UnsupportedMediaType, match="no decodable"):
        sniff(data)
    with pytest.raises(UndecodableMediaError, match="no decoder"):
        probe_video(MediaItem(MediaKind.VIDEO, "matroska", data))


def test_an_arriving_file_is_decoded_early_from_the_probed_track() -> None:
    """The decode of arriving bytes chooses the stream as the probe does: its frames are track 1's,
    taken by production and equal to the whole-bytes decode (before, it tried track 0 and kept
    nothing)."""
    data = two_track_mkv(unknown=1)
    early, _, sender = start_early(data, "matroska", SAMPLING, chunk=512)
    sender.join()
    assert early.join(10.0)
    item = MediaItem(MediaKind.VIDEO, "matroska", data)
    info = probe_video(item)
    assert early.stream_index == info.stream == 1
    sampled = sample_frames(info.total_frames, info.video_fps, SAMPLING)
    tp, size = 2, (24, 32)
    chunks = plan_chunks(list(range(sampled.num_frames // tp)), sampled.indices, info.keyframes, tp, 2)
    assert chunks_for_early(early, info, sampled.indices, chunks, tp) == set(range(len(chunks)))
    assert early_chunks_match_whole(early, item, info, sampled.indices, chunks, tp, size) > 0
    whole = decode_range(item, info, sorted(set(sampled.indices)), size=size)
    assert abs(float(whole.float().mean()) - 200) < 8 and not torch.equal(whole, torch.zeros_like(whole))
