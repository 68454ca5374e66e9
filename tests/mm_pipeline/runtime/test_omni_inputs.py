"""Omni request inputs before the engine: preprocessing matches the encoders' reference (image, video
groups, audio token counts), chat message parsing and its 400 errors, and the keyframe-aligned video
chunk plan. (The incremental detokenizer's tests live in tests/llm_core/engine/test_detokenizer.py.)"""

from __future__ import annotations

import pytest
import torch

from encoders.image_processing import ImageProcessingConfig, preprocess_image
from samples.checkpoints.tiny_towers import tiny_audio_config
from mm_pipeline.errors import InvalidInputError, InvalidMessageError, MediaError
from mm_pipeline.prompt.messages import MediaRef, parse_messages
from mm_pipeline.server.errors import http_answer
from mm_pipeline.media.types import DecodedAudio, DecodedImage, MediaKind
from mm_pipeline.encode.preprocess import Preprocessor


# ---- preprocessing -----------------------------------------------------------------------------
def test_preprocess_matches_encoders_reference_and_metadata_sizes():
    cfg = ImageProcessingConfig(min_pixels=32 * 32, max_pixels=96 * 96)
    pre = Preprocessor(cfg, tiny_audio_config())
    pixels = torch.randint(0, 256, (50, 77, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    got = pre.image(DecodedImage(pixels, "png"))
    rows, grid = preprocess_image(pixels.permute(2, 0, 1).float(), cfg)
    torch.testing.assert_close(got.rows, rows)
    assert got.grid == grid
    h, w = pre.image_size(50, 77)
    assert got.grid == (1, h // 16, w // 16) and pre.unit_tokens("image", got.grid) == (got.num_patches // 4,)
    # video groups: one input per pair of frames, same size for all
    frames = torch.randint(0, 256, (4, 40, 60, 3), dtype=torch.uint8)
    size = pre.video_size(40, 60, 4)
    groups = pre.video_groups(frames, size)
    assert len(groups) == 2 and all(g.grid == (1, size[0] // 16, size[1] // 16) for g in groups)
    assert pre.video_grid(size, 4) == (2, size[0] // 16, size[1] // 16)
    with pytest.raises(ValueError, match="multiple of 2"):
        pre.video_groups(frames[:3], size)
    # audio: per-segment token counts from the sample count alone, one per mel segment
    cfg_a = tiny_audio_config()
    samples = 240 * 250
    mels = pre.audio_segments(DecodedAudio(torch.zeros(samples), cfg_a.sampling_rate, "wav"))
    sizes = pre.unit_tokens("audio", (cfg_a.num_mel_frames(samples),))
    assert sizes == tuple(cfg_a.segment_tokens(int(m.shape[0])) for m in mels) and len(mels) > 1


# ---- chat parsing ------------------------------------------------------------------------------
def test_parse_messages_parts_and_errors():
    chat = parse_messages([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "video_url", "video_url": {"url": "/abs/video.mp4"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "file", "file": {"file_id": "file-1"}},
            {"type": "text", "text": "what?"}]},
    ])
    media = chat.media
    assert [m.kind for m in media] == [MediaKind.IMAGE, MediaKind.VIDEO, MediaKind.AUDIO, None]
    assert media[1].source.path == "/abs/video.mp4" and media[3].file_id == "file-1"
    # a bare base64 payload is kept as the very string that came (no data-URL copy on the loop)
    payload = "UklGRg==" * 4096
    part = {"type": "input_audio", "input_audio": {"data": payload, "format": "wav"}}
    assert parse_messages([{"role": "user", "content": [part]}]).media[0].source.base64 is payload
    files = parse_messages([{"role": "user", "content": [{"type": "file", "file": {"file_data": payload}},
                                                         {"type": "file", "file": {"file_data": "data:;base64,AA"}}]}])
    assert files.media[0].source.base64 is payload and files.media[1].source.url == "data:;base64,AA"
    assert chat.turns[1].parts[-1] == "what?"
    for bad, msg in [([], "non-empty list"), ([{"role": "robot", "content": "x"}], "role"),
                     ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x"}}]}],
                      "unsupported URL"),
                     # the scheme is read from the first 64 characters only: a longer one is none
                     ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "h" * 70 + "://x"}}]}],
                      "unsupported URL"),
                     ([{"role": "user", "content": [{"type": "hologram"}]}], "unsupported type"),
                     ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "base64")]:
        with pytest.raises(InvalidMessageError, match=msg) as info:
            parse_messages(bad)
        # a malformed message is the caller's bad input, not a media problem
        assert isinstance(info.value, InvalidInputError) and not isinstance(info.value, MediaError)
        assert info.value.kind == "invalid_input" and http_answer(type(info.value)).status == 400
    with pytest.raises(ValueError):
        MediaRef(MediaKind.IMAGE)


# ---- video chunk plan --------------------------------------------------------------------------
def test_video_chunks_follow_keyframes():
    from mm_pipeline.media.decode.video_chunks import plan_chunks

    indices = list(range(0, 40, 2))  # 20 sampled frames -> 10 groups, group g = frames 4g, 4g+2
    every8 = tuple(range(0, 40, 8))
    # keyframe every 8 source frames: each chunk of 2 groups (8 frames) starts at its own keyframe
    assert plan_chunks(range(10), indices, every8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    # one keyframe only: every later chunk would re-decode from frame 0 -> one chunk
    assert plan_chunks(range(10), indices, (0,), 2, 2) == [list(range(10))]
    # cached groups (2, 3) leave a gap: the run restarts after it
    assert plan_chunks([0, 1, 4, 5, 6], indices, every8, 2, 2) == [[0, 1], [4, 5], [6]]
    # a keyframe a little before each chunk: re-decoding the small overlap beats losing the stream
    late = (0, 6, 14)  # chunk 1 (frames 8..14) seeks to 6, chunk 2 (16..22) to 14: overlap 1 frame
    assert plan_chunks(range(6), indices, late, 2, 2) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="groups_per_chunk"):
        plan_chunks([0], indices, every8, 2, 0)


def _frames_decoded(chunks, indices, keyframes, tp):
    """Per source frame, how many chunks decode it (each from its seek point, skipping the gaps
    ``decode_runs`` jumps over)."""
    from mm_pipeline.media.decode.video import decode_runs

    count: dict[int, int] = {}
    for groups in chunks:
        targets = sorted({indices[g * tp + j] for g in groups for j in range(tp)})
        first = max(k for k in keyframes if k <= targets[0])
        runs = decode_runs(targets, keyframes, first)
        for (start, until) in runs:
            for f in range(start, targets[until - 1] + 1):
                count[f] = count.get(f, 0) + 1
    return count


def test_streamed_chunks_decode_each_frame_once():
    """The served 20 s clip's sampling: 30 fps, 40 frames sampled (2 groups per 2 s GOP). Chunks
    whose groups reach the encoder only at their end (min_chunks 0) re-decode a GOP's first 16
    frames for its second group; when the decoder streams groups (min_chunks = 2 per worker), a
    group joins the chunk its seek point lies in: one chunk per GOP, no frame decoded twice."""
    import numpy as np

    from mm_pipeline.media.decode.video_chunks import plan_chunks

    indices = np.linspace(0, 599, 40).astype(int).tolist()
    keys = tuple(range(0, 600, 60))
    old = plan_chunks(range(20), indices, keys, 2, 1)
    new = plan_chunks(range(20), indices, keys, 2, 1, min_chunks=4)
    seeks = [max(k for k in keys if k <= indices[c[0] * 2]) for c in new]
    assert len(new) == 10 and seeks == list(keys)  # one chunk per GOP
    assert [g for c in new for g in c] == list(range(20))
    assert max(_frames_decoded(new, indices, keys, 2).values()) == 1
    assert max(_frames_decoded(old, indices, keys, 2).values()) == 2  # the waste this removes
    assert sum(_frames_decoded(new, indices, keys, 2).values()) < sum(_frames_decoded(old, indices, keys, 2).values())
    # the workers still share the work: a chunk stops growing at 1/min_chunks of the groups and
    # re-decodes the small overlap instead (keyframes at 0 and 6 only: every overlap is 1 frame)
    small = list(range(0, 80, 4))  # 10 groups of frames (8g, 8g + 4)
    capped = plan_chunks(range(10), small, (0, 6), 2, 1, min_chunks=4)
    assert capped == plan_chunks(range(10), small, (0, 6), 2, 1)  # overlap >= own: joined either way
    every = plan_chunks(range(12), list(range(0, 48, 2)), (0, *range(2, 48, 4)), 2, 1, min_chunks=4)
    assert [len(c) for c in every] == [3, 3, 3, 3]  # overlap 1 < own 3 each time: cut at the cap
    with pytest.raises(ValueError, match="min_chunks"):
        plan_chunks([0], small, (0,), 2, 1, min_chunks=-1)
