"""The synthetic caption task generator (issue F item 1): parameters follow the spec, are seeded and
independent per item, and the written files decode to the right size, timing, colours and pitches."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from samples.synthetic import (
    AudioSpec, BeepSpec, ImageSpec, ShapeSpec, VideoSpec, sample_audio, sample_image, sample_video, synthesize,
    write_audio, write_image, write_video,
)
from samples.synthetic.draw import coverage, render
from samples.synthetic.generate import generate, main, read_labels
from samples.synthetic.spec import COLOURS, PITCHES

SEEDS = st.integers(0, 2**32 - 1)
INDICES = st.integers(0, 10**6)
IMAGE_CAPTION = re.compile(r"^a (red|green|blue|yellow) (circle|square|triangle)"
                           r"( and a (red|green|blue|yellow) (circle|square|triangle))?$")
VIDEO_CAPTION = re.compile(r"^a (circle|square|triangle) that is (red|green|blue|yellow)"
                           r"(, then (red|green|blue|yellow)){0,3}$")
AUDIO_CAPTION = re.compile(r"^beeps: (low|high)(, (low|high)){0,3}$")


def nearest_colour(rgb: np.ndarray) -> str:
    return min(COLOURS, key=lambda c: float(np.sum((np.asarray(COLOURS[c]) - rgb.astype(float)) ** 2)))


# --- parameters ------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(seed=SEEDS, index=INDICES)
def test_image_params_follow_spec(seed: int, index: int) -> None:
    spec = sample_image(seed, index)
    assert spec == sample_image(seed, index)                       # deterministic
    assert 96 <= spec.width <= 640 and 96 <= spec.height <= 640 and 0 <= spec.gray <= 255
    assert len(spec.shapes) in (1, 2)
    m = min(spec.width, spec.height)
    for s in spec.shapes:
        assert 0.2 * m <= s.side <= 0.4 * m
        assert s.x >= 0 and s.y >= 0 and s.x + s.side <= spec.width and s.y + s.side <= spec.height
    if len(spec.shapes) == 2:
        a, b = spec.shapes
        assert not a.overlaps(b)
        assert abs(a.centre[0] - b.centre[0]) >= 0.15 * spec.width
    assert spec.format != "jpeg" or spec.quality >= 85
    assert IMAGE_CAPTION.match(spec.caption)
    left_to_right = sorted(spec.shapes, key=lambda s: s.centre[0])
    assert spec.caption == " and ".join(f"a {s.colour} {s.kind}" for s in left_to_right)


@settings(max_examples=300, deadline=None)
@given(seed=SEEDS, index=INDICES)
def test_video_params_follow_spec(seed: int, index: int) -> None:
    spec = sample_video(seed, index)
    assert spec == sample_video(seed, index)
    assert spec.width % 2 == 0 and spec.height % 2 == 0
    assert 96 <= spec.width <= 480 and 96 <= spec.height <= 480 and spec.fps in (10, 24, 30)
    k = len(spec.colours)
    assert 1 <= k <= 4 and all(a != b for a, b in zip(spec.colours, spec.colours[1:]))
    assert max(2, k) <= spec.duration_s <= 60
    m, s = min(spec.width, spec.height), spec.shape
    assert 0.2 * m <= s.side <= 0.4 * m
    assert s.x + s.side <= spec.width and s.y + s.side <= spec.height
    # Every colour segment lasts >= 1 s and the segments are equal to within one frame.
    counts = np.bincount([spec.colour_index(i) for i in range(spec.n_frames)], minlength=k)
    assert counts.min() >= spec.fps and counts.max() - counts.min() <= 1
    assert VIDEO_CAPTION.match(spec.caption)
    assert spec.caption == f"a {s.kind} that is " + ", then ".join(spec.colours)


@settings(max_examples=300, deadline=None)
@given(seed=SEEDS, index=INDICES)
def test_audio_params_follow_spec(seed: int, index: int) -> None:
    spec = sample_audio(seed, index)
    assert spec == sample_audio(seed, index)
    assert spec.sample_rate in (16000, 22050, 44100, 48000) and spec.channels in (1, 2)
    assert spec.format != "opus" or spec.sample_rate == 48000
    beeps = spec.beeps
    assert 1 <= len(beeps) <= 4
    assert 0 <= beeps[0].start_s <= 0.5
    for b in beeps:
        assert 0.15 <= b.length_s <= 0.4 and 0.3 <= b.amplitude <= 0.8
    for a, b in zip(beeps, beeps[1:]):
        assert 0.1 - 1e-9 <= b.start_s - (a.start_s + a.length_s) <= 0.5 + 1e-9
    trail = spec.duration_s - (beeps[-1].start_s + beeps[-1].length_s)
    assert -1e-9 <= trail <= 0.5 + 1e-9
    assert AUDIO_CAPTION.match(spec.caption)
    assert 0 <= len(synthesize(spec)) - round(spec.duration_s * spec.sample_rate) <= 1
    assert spec.caption == "beeps: " + ", ".join(b.pitch for b in beeps)


def test_sampling_covers_every_choice() -> None:
    """Over many items every discrete choice shows up and sizes reach both ends of their ranges."""
    images = [sample_image(3, i) for i in range(400)]
    videos = [sample_video(3, i) for i in range(200)]
    audios = [sample_audio(3, i) for i in range(200)]
    shapes = [s for im in images for s in im.shapes]
    assert {s.colour for s in shapes} == set(COLOURS)
    assert {s.kind for s in shapes} == {"circle", "square", "triangle"}
    assert {len(im.shapes) for im in images} == {1, 2}
    assert {im.format for im in images} == {"png", "jpeg", "webp"}
    assert min(im.width for im in images) < 120 and max(im.width for im in images) > 610
    assert {len(v.colours) for v in videos} == {1, 2, 3, 4} and {v.fps for v in videos} == {10, 24, 30}
    assert {v.format for v in videos} == {"mp4", "webm"}
    assert max(v.duration_s for v in videos) > 50
    assert {b.pitch for a in audios for b in a.beeps} == set(PITCHES)
    assert {a.format for a in audios} == {"wav", "flac", "mp3", "opus"}
    assert {a.sample_rate for a in audios} == {16000, 22050, 44100, 48000}
    assert {a.channels for a in audios} == {1, 2}


def test_items_independent_and_format_flag_keeps_content() -> None:
    assert sample_image(5, 7) != sample_image(5, 8) and sample_image(5, 7) != sample_image(6, 7)
    for fmt in ("png", "jpeg", "webp"):
        assert sample_image(5, 7, fmt) == replace(sample_image(5, 7), format=fmt)
    for fmt in ("mp4", "webm"):
        assert sample_video(5, 7, fmt) == replace(sample_video(5, 7), format=fmt)
    base = sample_audio(5, 7, "wav")
    assert sample_audio(5, 7, "flac") == replace(base, format="flac")
    assert sample_audio(5, 7, "opus") == replace(base, format="opus", sample_rate=48000)


def test_max_video_seconds_caps_duration_and_colour_count() -> None:
    for i in range(100):
        v = sample_video(1, i, max_seconds=3.5)
        assert v.duration_s <= 3.5 and len(v.colours) <= 3 and v.duration_s >= max(2, len(v.colours))
    with pytest.raises(ValueError, match="max_seconds"):
        sample_video(1, 0, max_seconds=1.5)


def test_bad_specs_are_rejected() -> None:
    shape = ShapeSpec("circle", "red", 0, 0, 30)
    with pytest.raises(ValueError, match="JPEG quality"):
        ImageSpec(100, 100, 0, (shape,), "jpeg", quality=80)
    with pytest.raises(ValueError, match="even"):
        VideoSpec(97, 96, 10, 20, 0, shape, ("red",), "mp4")
    with pytest.raises(ValueError, match="consecutive"):
        VideoSpec(96, 96, 10, 20, 0, shape, ("red", "red"), "mp4")
    with pytest.raises(ValueError, match="Opus"):
        AudioSpec(16000, 1, (BeepSpec("low", 0.0, 0.2, 0.5),), 0.3, "opus")
    with pytest.raises(ValueError, match="inside"):
        AudioSpec(16000, 1, (BeepSpec("low", 0.2, 0.2, 0.5),), 0.3, "wav")
    with pytest.raises(ValueError, match="colour"):
        ShapeSpec("circle", "purple", 0, 0, 30)
    with pytest.raises(ValueError, match="outside"):
        render(40, 40, 0, (ShapeSpec("square", "red", 20, 20, 30),))


# --- rasterising and synthesis (no codec) ----------------------------------------------------------

@pytest.mark.parametrize("kind,area", [("square", 1.0), ("circle", np.pi / 4), ("triangle", 0.5)])
def test_coverage_area_matches_geometry(kind: str, area: float) -> None:
    cov = coverage(ShapeSpec(kind, "red", 0, 0, 64))
    assert abs(cov.sum() / 64**2 - area) < 0.01
    assert cov.min() >= 0.0 and cov.max() <= 1.0
    assert np.allclose(cov, cov[:, ::-1])                      # all three are mirror-symmetric in x
    if kind == "triangle":                                     # apex up: rows fill up downwards
        rows = cov.sum(axis=1)
        assert np.all(np.diff(rows) > 0) and rows[0] < 1.0 and rows[-1] > 63.0


def test_render_exact_colours() -> None:
    spec = sample_image(11, 0, "png")
    img = render(spec.width, spec.height, spec.gray, spec.shapes)
    for s in spec.shapes:
        x, y = s.interior_point
        assert tuple(img[int(y), int(x)]) == COLOURS[s.colour]
    mask = np.ones(img.shape[:2], dtype=bool)
    for s in spec.shapes:
        mask[s.y:s.y + s.side, s.x:s.x + s.side] = False
    assert np.all(img[mask] == spec.gray)


def test_synthesize_places_beeps_with_fades() -> None:
    spec = AudioSpec(16000, 1, (BeepSpec("low", 0.1, 0.2, 0.5), BeepSpec("high", 0.45, 0.15, 0.8)),
                     0.7, "wav")
    x = synthesize(spec)
    assert x.shape == (round(0.7 * 16000),) and x.dtype == np.float32
    assert np.all(x[:1600] == 0) and np.all(x[1600 + 3200:7200] == 0) and np.all(x[7200 + 2400:] == 0)
    assert np.max(np.abs(x[1600:4800])) <= 0.5 + 1e-6 and np.max(np.abs(x[7200:9600])) > 0.79
    fade = np.abs(x[1600:1760])                       # 10 ms fade-in: bounded by a linear ramp
    assert np.all(fade <= 0.5 * np.arange(160) / 160 + 1e-6)


# --- files -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,tol", [("png", 0), ("jpeg", 12), ("webp", 12)])
def test_image_file_decodes_to_spec(tmp_path, fmt: str, tol: int) -> None:
    spec = sample_image(21, 4, fmt)
    img = np.asarray(Image.open(write_image(spec, tmp_path / f"x.{fmt}")).convert("RGB")).astype(int)
    assert img.shape == (spec.height, spec.width, 3)
    for s in spec.shapes:
        x, y = s.interior_point
        assert np.abs(img[int(y), int(x)] - COLOURS[s.colour]).max() <= tol
    assert np.abs(img[0, 0] - spec.gray).max() <= tol or any(s.x == 0 and s.y == 0 for s in spec.shapes)


@pytest.mark.parametrize("fmt,codec", [("mp4", "h264"), ("webm", "vp9")])
def test_video_file_decodes_to_spec(tmp_path, fmt: str, codec: str) -> None:
    spec = VideoSpec(112, 96, 10, 31, 128, ShapeSpec("triangle", "red", 40, 30, 36),
                     ("red", "blue", "yellow"), fmt)
    with av.open(str(write_video(spec, tmp_path / f"v.{fmt}"))) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == codec and stream.average_rate == 10
        assert stream.codec_context.pix_fmt == "yuv420p"
        frames = list(container.decode(stream))
    assert len(frames) == spec.n_frames
    assert abs(float(frames[-1].time) - (spec.n_frames - 1) / spec.fps) < 1e-3
    x, y = spec.shape.interior_point
    for i, frame in enumerate(frames):
        assert (frame.width, frame.height) == (112, 96)
        rgb = frame.to_ndarray(format="rgb24")
        # Colour j is shown for t in [j D/k, (j+1) D/k): derive it from the decoded timestamp.
        expected = spec.colours[int(float(frame.time) * len(spec.colours) / spec.duration_s + 1e-6)]
        assert nearest_colour(rgb[int(y), int(x)]) == expected
        assert np.abs(rgb[int(y), int(x)].astype(int) - COLOURS[expected]).max() <= 25
        assert np.abs(rgb[2, 2].astype(int) - 128).max() <= 6


def detect_beeps(signal: np.ndarray, rate: int) -> list[tuple[float, str]]:
    """(onset seconds, 'low'/'high') of each run of 10 ms windows with RMS above 0.1."""
    win = rate // 100
    rms = np.sqrt(np.mean(signal[: len(signal) // win * win].reshape(-1, win) ** 2, axis=1))
    loud = np.concatenate([[False], rms > 0.1, [False]])
    starts, ends = np.flatnonzero(~loud[:-1] & loud[1:]), np.flatnonzero(loud[:-1] & ~loud[1:])
    found = []
    for a, b in zip(starts, ends):
        seg = signal[a * win:b * win] * np.hanning((b - a) * win)
        freq = np.argmax(np.abs(np.fft.rfft(seg))) * rate / len(seg)
        pitch = min(PITCHES, key=lambda p: abs(PITCHES[p] - freq))
        assert abs(PITCHES[pitch] - freq) < 0.05 * PITCHES[pitch], f"peak at {freq:.1f} Hz"
        found.append((a * win / rate, pitch))
    return found


@pytest.mark.parametrize("fmt,rate,channels", [("wav", 16000, 2), ("flac", 22050, 1),
                                               ("mp3", 44100, 2), ("opus", 48000, 1)])
def test_audio_file_decodes_to_spec(tmp_path, fmt: str, rate: int, channels: int) -> None:
    beeps = (BeepSpec("high", 0.05, 0.2, 0.6), BeepSpec("low", 0.37, 0.15, 0.3),
             BeepSpec("low", 0.62, 0.3, 0.8))
    spec = AudioSpec(rate, channels, beeps, 1.1, fmt)
    with av.open(str(write_audio(spec, tmp_path / f"a.{fmt}"))) as container:
        stream = container.streams.audio[0]
        assert stream.rate == rate and stream.channels == channels
        pcm = np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1)
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32768.0
    planes = pcm.reshape(-1, channels).T if pcm.shape[0] == 1 else pcm   # packed: L R L R ...
    assert np.allclose(planes[0], planes[-1], atol=1e-4)                 # same signal both sides
    assert abs(planes.shape[1] / rate - spec.duration_s) < 0.03
    found = detect_beeps(planes[0], rate)
    assert [p for _, p in found] == [b.pitch for b in beeps]
    for (onset, _), b in zip(found, beeps):
        assert abs(onset - b.start_s) < 0.03


# --- the generator ---------------------------------------------------------------------------------

def test_generate_writes_labels_and_is_deterministic(tmp_path) -> None:
    labels = generate(9, tmp_path / "a", images=3, audios=2, image_format="png", audio_format="flac")
    assert [(r["modality"], r["index"]) for r in labels] == [("image", 0), ("image", 1), ("image", 2),
                                                             ("audio", 0), ("audio", 1)]
    assert read_labels(tmp_path / "a") == labels
    for r in labels:
        assert (tmp_path / "a" / r["path"]).is_file()
        assert r["prompt"] == f"Describe this {r['modality']}."
    assert labels[0]["caption"] == sample_image(9, 0, "png").caption
    # Fewer items, other counts, two worker processes: the shared items are byte-identical.
    again = generate(9, tmp_path / "b", images=2, image_format="png", workers=2)
    assert again == labels[:2]
    for r in again:
        assert (tmp_path / "a" / r["path"]).read_bytes() == (tmp_path / "b" / r["path"]).read_bytes()


def test_cli_writes_every_modality(tmp_path) -> None:
    main(["--seed", "2", "--out", str(tmp_path), "--images", "1", "--videos", "1", "--audios", "1",
          "--max-video-seconds", "2", "--video-format", "webm"])
    records = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert [r["modality"] for r in records] == ["image", "video", "audio"]
    video = records[1]
    assert video["path"].endswith(".webm") and video["duration_s"] == 2.0
    assert VIDEO_CAPTION.match(video["caption"])
    with pytest.raises(ValueError, match="format"):
        generate(0, tmp_path, images=1, image_format="gif")


def test_committed_samples_match_their_labels() -> None:
    """samples/media was written by the CLI (seed 8082, 3/2/4 items and 1 beeping video as MP4, 6 s
    videos): the labels still follow from the sampler, the files decode to the labelled sizes/rates,
    and the set stays small."""

    from samples.synthetic.generate import ItemJob, label, sample_spec

    from tests.support.paths import SAMPLE_MEDIA as media
    records = read_labels(media)
    assert {r["modality"] for r in records} == {"image", "video", "audio"}
    assert sum(p.stat().st_size for p in media.iterdir()) < 2_000_000
    assert sum(r["path"].startswith("video_sound_") for r in records) == 1
    for r in records:
        # a beeping video is labelled "video" (what the server sees); its own sampler drew it
        modality = "beeping_video" if r["path"].startswith("video_sound_") else r["modality"]
        job = ItemJob(modality, r["seed"], r["index"], r["format"], 6.0)
        assert label(job, sample_spec(job), r["path"]) == r
        with av.open(str(media / r["path"])) as container:
            if r["modality"] == "audio":
                stream = container.streams.audio[0]
                assert (stream.rate, stream.channels) == (r["sample_rate"], r["channels"])
            else:
                stream = container.streams.video[0]
                assert (stream.codec_context.width, stream.codec_context.height) == (r["width"], r["height"])
                if r["modality"] == "video":
                    assert sum(1 for _ in container.decode(stream)) == r["n_frames"]
                if modality == "beeping_video":
                    assert container.streams.audio[0].rate == r["sample_rate"]
