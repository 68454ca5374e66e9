"""Decoding only what the sampled frames need: unsampled frames no other frame is predicted from are
dropped (H.264, MPEG-4 part 2, HEVC with one temporal sub-layer), and whatever is sampled, cut into
whatever ranges, the frames equal a decode of every frame."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.media_samples import FrameCounter, level_to_frame, video_bytes

from mm_pipeline.media.decode.video import decode_range, hevc_single_sublayer, probe_video, skips_nonref
from mm_pipeline.media.decode.video_chunks import VideoContainers
from mm_pipeline.media.sniff import open_av
from mm_pipeline.media.types import MediaItem, MediaKind

CODECS = [("mp4", "mpeg4"), ("mp4", "libx264"), ("webm", "libvpx"), ("webm", "libvpx-vp9")]


def _video(container: str, codec: str, **kw: object) -> MediaItem:
    return MediaItem(MediaKind.VIDEO, container, video_bytes(container, codec, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(("codec", "bframes"), [("libx264", 0), ("mpeg4", 2)])
@pytest.mark.parametrize("threads", [1, 0])
def test_unsampled_nonreference_frames_are_not_decoded(codec: str, bframes: int, threads: int) -> None:
    """H.264 (x264's B-pyramid) and MPEG-4 part 2 with B-frames: the frames no other frame is
    predicted from are dropped unless sampled -- the same frames as a decode of every frame, from
    fewer decoded frames; with dropping off, the seeking decode produces every one of them."""
    item = _video("mp4", codec, fps=10, n_frames=60, gop=30, bframes=bframes)
    info = probe_video(item)
    targets = list(range(0, 60, 5)) + [59]
    full, dropping, keeping = FrameCounter(), FrameCounter(), FrameCounter()
    ref = decode_range(item, info, targets, seek=False, control=full, threads=threads)
    out = decode_range(item, info, targets, control=dropping, threads=threads)
    kept = decode_range(item, info, targets, control=keeping, threads=threads, drop_nonref=False)
    assert torch.equal(out, ref) and torch.equal(kept, ref)
    if codec == "libx264":  # (MPEG-4's B-frames are coded too coarsely to tell the levels apart)
        assert [level_to_frame(float(f[30, 5, 0]), i) for f, i in zip(out, targets)] == targets
    # x264: 39 of 58 frames decoded; MPEG-4 (a keyframe at most scene cuts): 22 of 28
    assert full.frames == 60 and dropping.frames <= keeping.frames - 6


_BFRAME_CLIPS: dict[str, tuple[MediaItem, torch.Tensor]] = {}


def _bframe_clip(codec: str) -> tuple[MediaItem, torch.Tensor]:
    """A B-frame clip (keyframes every 16 frames, a scene cut or two more) and every frame of it
    from a full decode (the reference), made once per test session."""
    if codec not in _BFRAME_CLIPS:
        item = _video("mp4", codec, fps=10, n_frames=64, gop=16, bframes=2)
        info = probe_video(item)
        _BFRAME_CLIPS[codec] = item, decode_range(item, info, list(range(info.total_frames)), seek=False)
    return _BFRAME_CLIPS[codec]


@settings(max_examples=25, deadline=None)
@given(codec=st.sampled_from(["libx264", "mpeg4"]), picks=st.sets(st.integers(0, 63), min_size=1, max_size=20),
       split=st.integers(0, 3))
def test_any_targets_decode_as_the_full_decode_does(codec: str, picks: set[int], split: int) -> None:
    """Whatever frames are sampled, cut into whatever ranges (each from its own seek point, non-
    reference frames dropped, sharing one set of open containers), they are the full decode's."""
    item, every = _bframe_clip(codec)
    info = probe_video(item)
    targets = sorted(picks)
    shared = VideoContainers(item)
    try:
        cut = max(1, len(targets) // (split + 1))
        parts = [decode_range(item, info, targets[k:k + cut], containers=shared) for k in range(0, len(targets), cut)]
    finally:
        shared.close()
    assert torch.equal(torch.cat(parts), every[targets])


@pytest.mark.parametrize(("container", "codec"), CODECS)
def test_frames_are_dropped_only_where_no_frame_refers_to_them(container: str, codec: str) -> None:
    """H.264 and MPEG-4 part 2 drop unsampled non-reference frames; VP8/VP9 keep decoding all."""
    with open_av(_video(container, codec).data) as c:
        assert skips_nonref(c.streams.video[0]) == (codec in ("libx264", "mpeg4"))


def test_hevc_drops_frames_only_with_one_temporal_sublayer() -> None:
    """x265 in MP4 declares one temporal sub-layer (hvcC): its unsampled non-reference pictures are
    dropped and the sampled frames are the full decode's; a record declaring two sub-layers, none,
    or Annex B start codes (MPEG-TS) keeps every frame decoded."""
    item = _video("mp4", "libx265", fps=10, n_frames=60, gop=30)
    info = probe_video(item)
    with open_av(item.data) as c:
        extradata = c.streams.video[0].codec_context.extradata
        assert skips_nonref(c.streams.video[0])
    targets = list(range(0, 60, 5)) + [59]
    full, dropping = FrameCounter(), FrameCounter()
    ref = decode_range(item, info, targets, seek=False, control=full)
    assert torch.equal(decode_range(item, info, targets, control=dropping), ref)
    assert full.frames == 60 and dropping.frames < 50
    two = bytearray(extradata)
    two[21] = (two[21] & ~0x38) | (2 << 3)
    unknown = bytearray(extradata)
    unknown[21] &= ~0x38
    assert hevc_single_sublayer(extradata)
    assert not hevc_single_sublayer(bytes(two)) and not hevc_single_sublayer(bytes(unknown))
    assert not hevc_single_sublayer(b"\x00\x00\x00\x01\x40\x01\x0c\x01" * 4) and not hevc_single_sublayer(None)


def test_a_target_lost_while_dropping_frames_decodes_as_a_full_decode_would() -> None:
    """A sampled frame the decoder never emits under its timestamp (here: the probe's timestamp does
    not match its packet's, as in a damaged stream) while non-reference frames are dropped: the run
    is decoded again without dropping, so the frame standing in for it is the one a full decode
    gives."""
    item = _video("mp4", "libx264", fps=10, n_frames=40, gop=40)
    info = probe_video(item)
    pts = list(info.pts)
    lost = 17
    pts[lost] += 1  # still ascending (the clip's timestamps are steps of several units), matched by no frame
    assert pts[lost] < pts[lost + 1]
    info = dataclasses.replace(info, pts=tuple(pts))
    targets = [3, lost, 30]
    counter = FrameCounter()
    out = decode_range(item, info, targets, control=counter)
    ref = decode_range(item, info, targets, seek=False)
    assert torch.equal(out, ref)
    assert counter.frames > 31  # the run was decoded again
