"""Video frame groups: each 2-frame group encodes independently, so any batch split of the groups
(mixed with images or other videos) reproduces the whole-video encoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoders.image_processing import ImageProcessingConfig, normalize, patchify, preprocess_image
from samples.checkpoints.tiny_towers import init_random_, tiny_vision_config
from encoders.vision.tower import VisionTransformer
from encoders.video import VideoFrameGroups, format_timestamp, pad_to_groups, preprocess_video

CFG = ImageProcessingConfig(min_pixels=32 * 32, max_pixels=96 * 96, video_min_pixels=32 * 32,
                            video_max_pixels=96 * 96, video_total_max_pixels=96 * 96 * 4)
TOWER = init_random_(VisionTransformer(tiny_vision_config()), seed=11).eval()


def make_video(num_frames: int, h: int = 70, w: int = 120, seed: int = 0) -> VideoFrameGroups:
    g = torch.Generator().manual_seed(seed)
    frames = torch.rand(num_frames, 3, h, w, generator=g) * 255
    return preprocess_video(frames, [2.0 * i for i in range(num_frames)], CFG)


_WHOLE: dict[int, torch.Tensor] = {}


def whole_video(video: VideoFrameGroups, key: int) -> torch.Tensor:
    if key not in _WHOLE:
        _WHOLE[key] = TOWER(video.rows, [video.grid_thw])[0]
    return _WHOLE[key]


@settings(max_examples=10, deadline=None)
@given(cuts=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_any_batch_split_equals_whole_video(cuts):
    video = make_video(9)  # odd: padded to 10 frames = 5 groups
    whole = whole_video(video, 9)
    per_group = whole.shape[0] // video.num_groups
    outs, k = [], 0
    for size in cuts + [video.num_groups]:
        if k >= video.num_groups:
            break
        stop = min(video.num_groups, k + size)
        outs += TOWER.encode_items(video.groups(k, stop))
        k = stop
    assert len(outs) == video.num_groups and all(o.shape[0] == per_group for o in outs)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)


def test_groups_mixed_with_images_and_other_videos():
    a, b = make_video(4, seed=1), make_video(6, 64, 64, seed=2)
    image = preprocess_image(torch.rand(3, 50, 90) * 255, CFG)
    items = [a.group(1), image, b.group(0), a.group(0), b.group(2)]
    outs = TOWER.encode_items(items)
    wa, wb = TOWER(a.rows, [a.grid_thw])[0], TOWER(b.rows, [b.grid_thw])[0]
    na, nb = wa.shape[0] // a.num_groups, wb.shape[0] // b.num_groups
    torch.testing.assert_close(outs[0], wa[na:2 * na], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], TOWER.encode_items([image])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2], wb[:nb], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[3], wa[:na], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[4], wb[2 * nb:], atol=1e-5, rtol=1e-5)


def test_frames_of_a_group_do_not_see_other_groups():
    """Changing group 2's pixels leaves every other group's embeddings bit-identical."""
    video = make_video(6, seed=4)
    rows = video.rows.clone()
    n = video.tokens_per_group
    rows[2 * n:] += 1.0
    before = TOWER(video.rows, [video.grid_thw])[0]
    after = TOWER(rows, [video.grid_thw])[0]
    per = before.shape[0] // 3
    torch.testing.assert_close(after[:2 * per], before[:2 * per], atol=1e-6, rtol=1e-6)
    assert (after[2 * per:] - before[2 * per:]).abs().max() > 1e-3


def test_odd_frame_count_repeats_last_frame_and_timestamp():
    frames = torch.rand(3, 3, 64, 64) * 255
    padded, stamps = pad_to_groups(frames, [0.0, 1.0, 2.0])
    assert padded.shape[0] == 4 and torch.equal(padded[3], frames[2]) and stamps == [0.0, 1.0, 2.0, 2.0]
    video = preprocess_video(frames, [0.0, 1.0, 2.0], CFG)
    assert video.num_groups == 2 and video.timestamps == (0.0, 2.0)
    # group 1 = patchify of (frame 2, frame 2)
    rows, grid = patchify(normalize(padded[2:4]))
    assert grid == (1, *video.grid_hw)
    torch.testing.assert_close(video.group(1)[0], rows)
    with pytest.raises(ValueError, match="timestamps"):
        pad_to_groups(frames, [0.0])
    with pytest.raises(IndexError):
        video.group(2)


def test_video_pixel_budget_per_frame():
    assert CFG.video_frame_max_pixels(2) == 96 * 96
    assert CFG.video_frame_max_pixels(40) == max(32 * 32, 96 * 96 * 4 * 2 // 40)
    long = make_video(40, 200, 200)
    gh, gw = long.grid_hw
    assert gh * gw * 256 <= CFG.video_frame_max_pixels(40) and long.num_groups == 20


def test_timestamps_format():
    assert [format_timestamp(s) for s in (0, 2.9, 61, 3599.5, 6000)] == ["00:00", "00:02", "01:01", "59:59",
                                                                          "100:00"]
    video = make_video(4)
    assert [format_timestamp(t) for t in video.timestamps] == ["00:00", "00:04"]
    with pytest.raises(ValueError):
        format_timestamp(-1)
