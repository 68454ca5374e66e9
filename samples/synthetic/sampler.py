"""Seeded parameter sampling for the synthetic caption task, exactly per the issue F text.

Item ``i`` of modality ``m`` under seed ``S`` draws from its own generator, seeded by
``SeedSequence(S, spawn_key=(m, i, stream))``, so it does not depend on how many other items are
generated or in which order. Two streams per item: stream 0 draws the content (sizes, shapes,
colours, beeps), stream 1 draws the file format — forcing a format therefore leaves the content
unchanged (except the Opus sample rate, which the format pins to 48 kHz).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from samples.synthetic.spec import (
    AUDIO_FORMATS, AUDIO_SAMPLE_RATES, BEEP_AMPLITUDE_RANGE, BEEP_COUNT_RANGE, BEEP_GAP_RANGE_S,
    BEEP_LENGTH_RANGE_S, COLOURS, EDGE_SILENCE_RANGE_S, IMAGE_FORMATS, IMAGE_SIZE_RANGE,
    MIN_CENTRE_DX_FRACTION, OPUS_SAMPLE_RATE, PITCHES, SHAPES, SIDE_FRACTION_RANGE,
    VIDEO_DURATION_MAX_S, VIDEO_FORMATS, VIDEO_FPS, VIDEO_MAX_COLOURS, VIDEO_MIN_SEGMENT_S,
    VIDEO_SIZE_RANGE, AudioSpec, BeepSpec, ImageSpec, ShapeSpec, VideoSpec,
)

# "beeping_video": videos with a sound track (their own stream, so plain videos are unchanged)
MODALITY_KEYS: dict[str, int] = {"image": 0, "video": 1, "audio": 2, "beeping_video": 3}
_CONTENT_STREAM, _FORMAT_STREAM = 0, 1
_MAX_REJECTIONS = 10_000
_COLOUR_NAMES = tuple(COLOURS)
_PITCH_NAMES = tuple(PITCHES)


def item_rng(seed: int, modality: str, index: int, stream: int = _CONTENT_STREAM) -> np.random.Generator:
    """The generator for one stream of one item (see module docstring)."""
    if modality not in MODALITY_KEYS:
        raise ValueError(f"modality must be one of {sorted(MODALITY_KEYS)}, got {modality!r}")
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be non-negative, got seed={seed}, index={index}")
    ss = np.random.SeedSequence(seed, spawn_key=(MODALITY_KEYS[modality], index, stream))
    return np.random.default_rng(ss)


def _choose(rng: np.random.Generator, options: tuple) -> object:
    return options[int(rng.integers(len(options)))]


def _pick_format(seed: int, modality: str, index: int, allowed: tuple[str, ...],
                 forced: str | None) -> str:
    if forced is not None:
        if forced not in allowed:
            raise ValueError(f"{modality} format must be one of {allowed}, got {forced!r}")
        return forced
    return str(_choose(item_rng(seed, modality, index, _FORMAT_STREAM), allowed))


def side_range(min_dim: int) -> tuple[int, int]:
    """Integer bounding-box sides allowed for an image whose smaller dimension is ``min_dim``.

    Sides are whole pixels drawn uniformly from [ceil(0.2 m), floor(0.4 m)], which keeps every side
    inside the real interval [0.2 m, 0.4 m] the issue asks for.
    """
    lo, hi = SIDE_FRACTION_RANGE
    return math.ceil(lo * min_dim), math.floor(hi * min_dim)


def _sample_box(rng: np.random.Generator, width: int, height: int) -> tuple[int, int, int]:
    """(x, y, side) of a square box fully inside the image, position uniform over valid corners."""
    lo, hi = side_range(min(width, height))
    side = int(rng.integers(lo, hi + 1))
    x = int(rng.integers(0, width - side + 1))
    y = int(rng.integers(0, height - side + 1))
    return x, y, side


def sample_image(seed: int, index: int, fmt: str | None = None) -> ImageSpec:
    """Image item ``index``: size, gray background, 1-2 non-overlapping shapes, file format."""
    rng = item_rng(seed, "image", index)
    width = int(rng.integers(IMAGE_SIZE_RANGE[0], IMAGE_SIZE_RANGE[1] + 1))
    height = int(rng.integers(IMAGE_SIZE_RANGE[0], IMAGE_SIZE_RANGE[1] + 1))
    gray = int(rng.integers(0, 256))
    n_shapes = int(rng.integers(1, 3))
    kinds = [str(_choose(rng, SHAPES)) for _ in range(n_shapes)]
    colours = [str(_choose(rng, _COLOUR_NAMES)) for _ in range(n_shapes)]
    quality = int(rng.integers(85, 96))
    # Rejection sampling: redraw all boxes together until the constraints hold, so the accepted
    # layout is distributed as the independent draw conditioned on the constraints.
    for _ in range(_MAX_REJECTIONS):
        boxes = [_sample_box(rng, width, height) for _ in range(n_shapes)]
        shapes = tuple(ShapeSpec(k, c, x, y, s) for k, c, (x, y, s) in zip(kinds, colours, boxes))
        if layout_ok(shapes, width):
            # Store left to right (caption order); the shapes do not overlap, so draw order is moot.
            shapes = tuple(sorted(shapes, key=lambda s: s.centre[0]))
            break
    else:
        raise RuntimeError(f"no valid layout for a {width}x{height} image after {_MAX_REJECTIONS} draws")
    return ImageSpec(width=width, height=height, gray=gray, shapes=shapes,
                     format=_pick_format(seed, "image", index, IMAGE_FORMATS, fmt), quality=quality)


def layout_ok(shapes: tuple[ShapeSpec, ...], width: int) -> bool:
    """Two shapes: boxes disjoint and centres at least 0.15 W apart in x. One shape: always ok."""
    if len(shapes) < 2:
        return True
    a, b = shapes
    return (not a.overlaps(b)) and abs(a.centre[0] - b.centre[0]) >= MIN_CENTRE_DX_FRACTION * width


def sample_video(seed: int, index: int, fmt: str | None = None,
                 max_seconds: float = VIDEO_DURATION_MAX_S) -> VideoSpec:
    """Video item ``index``: even size, fps, one fixed shape, a 1-4 colour sequence, duration.

    ``max_seconds`` lowers the 60 s ceiling (for quick sample sets); colour counts ``k`` whose minimum
    duration max(2, k) would exceed it are not drawn. The duration is drawn uniformly in
    [max(2, k), min(60, max_seconds)] and rounded to the nearest whole frame; the bounds are whole
    seconds and fps is an integer, so rounding never leaves the interval.
    """
    return _sample_video("video", seed, index, fmt, max_seconds)[0]


def sample_beeping_video(seed: int, index: int, fmt: str | None = None,
                         max_seconds: float = VIDEO_DURATION_MAX_S) -> VideoSpec:
    """Beeping video item ``index``: a video as :func:`sample_video` draws it (from its own stream)
    plus 1-4 beeps, one in each of as many equal slots of the duration, at a random offset inside its
    slot (so a long video beeps across its whole length), lengths 0.15-0.4 s, random pitches."""
    video, rng = _sample_video("beeping_video", seed, index, fmt, max_seconds)
    n = int(rng.integers(BEEP_COUNT_RANGE[0], BEEP_COUNT_RANGE[1] + 1))
    slot = video.duration_s / n
    beeps = []
    for i in range(n):
        length = float(rng.uniform(BEEP_LENGTH_RANGE_S[0], min(BEEP_LENGTH_RANGE_S[1], 0.9 * slot)))
        start = i * slot + float(rng.uniform(0.0, slot - length))
        beeps.append(BeepSpec(str(_choose(rng, _PITCH_NAMES)), start, length,
                              float(rng.uniform(*BEEP_AMPLITUDE_RANGE))))
    return replace(video, beeps=tuple(beeps))


def _sample_video(key: str, seed: int, index: int, fmt: str | None,
                  max_seconds: float) -> tuple[VideoSpec, np.random.Generator]:
    if max_seconds < 2.0:
        raise ValueError(f"max_seconds must be >= 2 (the shortest video), got {max_seconds}")
    ceiling = min(VIDEO_DURATION_MAX_S, float(max_seconds))
    rng = item_rng(seed, key, index)
    half_lo, half_hi = VIDEO_SIZE_RANGE[0] // 2, VIDEO_SIZE_RANGE[1] // 2
    width = 2 * int(rng.integers(half_lo, half_hi + 1))
    height = 2 * int(rng.integers(half_lo, half_hi + 1))
    fps = int(_choose(rng, VIDEO_FPS))
    gray = int(rng.integers(0, 256))
    kind = str(_choose(rng, SHAPES))
    x, y, side = _sample_box(rng, width, height)
    max_k = min(VIDEO_MAX_COLOURS, int(math.floor(ceiling / VIDEO_MIN_SEGMENT_S)))
    k = int(rng.integers(1, max_k + 1))
    colours = [str(_choose(rng, _COLOUR_NAMES))]
    for _ in range(k - 1):
        # Consecutive colours differ: draw uniformly among the three others.
        colours.append(str(_choose(rng, tuple(c for c in _COLOUR_NAMES if c != colours[-1]))))
    lo = max(2.0, k * VIDEO_MIN_SEGMENT_S)
    duration = float(rng.uniform(lo, ceiling))
    n_frames = int(round(duration * fps))
    n_frames = min(max(n_frames, math.ceil(lo * fps)), math.floor(ceiling * fps))
    shape = ShapeSpec(kind, colours[0], x, y, side)
    return VideoSpec(width=width, height=height, fps=fps, n_frames=n_frames, gray=gray, shape=shape,
                     colours=tuple(colours),
                     format=_pick_format(seed, key, index, VIDEO_FORMATS, fmt)), rng


def sample_audio(seed: int, index: int, fmt: str | None = None) -> AudioSpec:
    """Audio item ``index``: rate, channels, 1-4 beeps with gaps and edge silences, file format."""
    rng = item_rng(seed, "audio", index)
    rate = int(_choose(rng, AUDIO_SAMPLE_RATES))
    channels = int(rng.integers(1, 3))
    n = int(rng.integers(BEEP_COUNT_RANGE[0], BEEP_COUNT_RANGE[1] + 1))
    pitches = [str(_choose(rng, _PITCH_NAMES)) for _ in range(n)]
    lengths = rng.uniform(*BEEP_LENGTH_RANGE_S, size=n)
    amplitudes = rng.uniform(*BEEP_AMPLITUDE_RANGE, size=n)
    gaps = rng.uniform(*BEEP_GAP_RANGE_S, size=n - 1)
    lead, trail = rng.uniform(*EDGE_SILENCE_RANGE_S, size=2)
    fmt_name = _pick_format(seed, "audio", index, AUDIO_FORMATS, fmt)
    if fmt_name == "opus":
        rate = OPUS_SAMPLE_RATE   # the rate draw above still happens so the stream stays aligned
    beeps = []
    t = float(lead)
    for i in range(n):
        beeps.append(BeepSpec(pitches[i], t, float(lengths[i]), float(amplitudes[i])))
        t += float(lengths[i]) + (float(gaps[i]) if i < n - 1 else 0.0)
    return AudioSpec(sample_rate=rate, channels=channels, beeps=tuple(beeps),
                     duration_s=t + float(trail), format=fmt_name)
