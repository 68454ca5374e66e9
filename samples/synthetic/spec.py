"""The synthetic caption task (issue F): constants and one frozen dataclass per generated item.

Everything a file is rendered from lives in these dataclasses, so a spec fully determines its file
(up to codec loss) and its caption. Captions are derived properties, never stored separately.

Geometry convention (pixels): a shape's bounding box is the half-open square
``[x, x + side) x [y, y + side)`` with integer corner ``(x, y)``; pixel ``(row i, col j)`` has its centre
at ``(j + 0.5, i + 0.5)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# --- constants from the issue text -----------------------------------------------------------------

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (240, 210, 40),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
PITCHES: dict[str, float] = {"low": 330.0, "high": 1320.0}

IMAGE_SIZE_RANGE = (96, 640)          # width and height, independently, inclusive
VIDEO_SIZE_RANGE = (96, 480)          # even values only
VIDEO_FPS = (10, 24, 30)
VIDEO_MAX_COLOURS = 4
VIDEO_DURATION_MAX_S = 60.0
VIDEO_MIN_SEGMENT_S = 1.0
SIDE_FRACTION_RANGE = (0.2, 0.4)      # bounding-box side as a fraction of min(W, H)
MIN_CENTRE_DX_FRACTION = 0.15         # two shapes: |cx1 - cx2| >= 0.15 * W

AUDIO_SAMPLE_RATES = (16000, 22050, 44100, 48000)
OPUS_SAMPLE_RATE = 48000
BEEP_COUNT_RANGE = (1, 4)
BEEP_LENGTH_RANGE_S = (0.15, 0.4)
BEEP_AMPLITUDE_RANGE = (0.3, 0.8)
BEEP_FADE_S = 0.010
BEEP_GAP_RANGE_S = (0.1, 0.5)
EDGE_SILENCE_RANGE_S = (0.0, 0.5)

IMAGE_FORMATS: tuple[str, ...] = ("png", "jpeg", "webp")
VIDEO_FORMATS: tuple[str, ...] = ("mp4", "webm")     # H.264 yuv420p / VP9
AUDIO_FORMATS: tuple[str, ...] = ("wav", "flac", "mp3", "opus")

FILE_EXTENSIONS: dict[str, str] = {
    "png": ".png", "jpeg": ".jpg", "webp": ".webp",
    "mp4": ".mp4", "webm": ".webm",
    "wav": ".wav", "flac": ".flac", "mp3": ".mp3", "opus": ".ogg",
}
PROMPTS: dict[str, str] = {
    "image": "Describe this image.",
    "video": "Describe this video.",
    "audio": "Describe this audio.",
}


def _check_choice(name: str, value: str, allowed: tuple[str, ...] | dict) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")


# --- visual items ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShapeSpec:
    """One solid shape inside its square bounding box (see module docstring for the convention).

    triangle: isosceles, apex up, base = height = side::

        (x + side/2, y)            apex
              /\\
             /  \\
            /____\\
        (x, y+side)   (x+side, y+side)
    """

    kind: str
    colour: str
    x: int
    y: int
    side: int

    def __post_init__(self) -> None:
        _check_choice("shape kind", self.kind, SHAPES)
        _check_choice("colour", self.colour, COLOURS)
        if self.side <= 0:
            raise ValueError(f"shape side must be positive, got {self.side}")

    @property
    def centre(self) -> tuple[float, float]:
        """Centre (x, y) of the bounding box."""
        return (self.x + self.side / 2.0, self.y + self.side / 2.0)

    @property
    def interior_point(self) -> tuple[float, float]:
        """A point deep inside the solid shape (for checking colours after lossy coding).

        For the triangle the box centre lies only ~0.22 side from the slanted edges; the centroid
        (2/3 of the way down from the apex) lies ~0.3 side from every edge.
        """
        cx, cy = self.centre
        if self.kind == "triangle":
            return (cx, self.y + 2.0 * self.side / 3.0)
        return (cx, cy)

    def overlaps(self, other: "ShapeSpec") -> bool:
        """True if the two half-open bounding boxes share any area."""
        return (self.x < other.x + other.side and other.x < self.x + self.side
                and self.y < other.y + other.side and other.y < self.y + self.side)

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.kind, "colour": self.colour, "x": self.x, "y": self.y, "side": self.side}


@dataclass(frozen=True)
class ImageSpec:
    """A uniform gray image with 1 or 2 shapes."""

    width: int
    height: int
    gray: int
    shapes: tuple[ShapeSpec, ...]
    format: str
    quality: int = 90   # JPEG / WebP quality; PNG ignores it

    def __post_init__(self) -> None:
        _check_choice("image format", self.format, IMAGE_FORMATS)
        if not 0 <= self.gray <= 255:
            raise ValueError(f"gray level must be in [0, 255], got {self.gray}")
        if not 1 <= len(self.shapes) <= 2:
            raise ValueError(f"an image holds 1 or 2 shapes, got {len(self.shapes)}")
        if self.format == "jpeg" and self.quality < 85:
            raise ValueError(f"JPEG quality must be >= 85, got {self.quality}")

    @property
    def caption(self) -> str:
        """Shapes from left to right (by centre x): 'a red circle and a blue square'."""
        ordered = sorted(self.shapes, key=lambda s: s.centre[0])
        return " and ".join(f"a {s.colour} {s.kind}" for s in ordered)

    def to_json(self) -> dict[str, Any]:
        return {"width": self.width, "height": self.height, "gray": self.gray, "format": self.format,
                "quality": self.quality, "shapes": [s.to_json() for s in self.shapes]}


@dataclass(frozen=True)
class VideoSpec:
    """One fixed shape whose colour steps through ``colours`` in equal segments; a *beeping* video
    also has a sound track (``beeps`` at ``sample_rate``, silence between them), and its caption
    names the beeps after the colours.

    The duration sits on the frame grid (``n_frames = duration_s * fps`` exactly); frame ``i`` shows
    ``colours[i * k // n_frames]``, i.e. the colour whose segment contains the frame's start time::

        t:   0        D/k       2D/k  ...   D
             |  c1     |   c2    | ...      |
    """

    width: int
    height: int
    fps: int
    n_frames: int
    gray: int
    shape: ShapeSpec            # its colour field is colours[0]
    colours: tuple[str, ...]
    format: str
    beeps: tuple["BeepSpec", ...] = ()
    sample_rate: int = OPUS_SAMPLE_RATE  # of the sound track (Opus in WebM needs 48 kHz)

    def __post_init__(self) -> None:
        _check_choice("video format", self.format, VIDEO_FORMATS)
        if len(self.beeps) > BEEP_COUNT_RANGE[1]:
            raise ValueError(f"a video has at most {BEEP_COUNT_RANGE[1]} beeps, got {len(self.beeps)}")
        for a, b in zip(self.beeps, self.beeps[1:]):
            if b.start_s < a.start_s + a.length_s:
                raise ValueError(f"beeps overlap or are out of order: {a} then {b}")
        if self.beeps and (self.beeps[0].start_s < 0
                           or self.beeps[-1].start_s + self.beeps[-1].length_s > self.n_frames / self.fps):
            raise ValueError("beeps must lie inside the video")
        if self.width % 2 or self.height % 2:
            raise ValueError(f"video size must be even, got {self.width}x{self.height}")
        if self.fps not in VIDEO_FPS:
            raise ValueError(f"fps must be one of {VIDEO_FPS}, got {self.fps}")
        if not 1 <= len(self.colours) <= VIDEO_MAX_COLOURS:
            raise ValueError(f"a video has 1-{VIDEO_MAX_COLOURS} colours, got {len(self.colours)}")
        for c in self.colours:
            _check_choice("colour", c, COLOURS)
        if any(a == b for a, b in zip(self.colours, self.colours[1:])):
            raise ValueError(f"consecutive colours must differ: {self.colours}")
        if self.n_frames < len(self.colours):
            raise ValueError(f"{self.n_frames} frames cannot show {len(self.colours)} colours")

    @property
    def duration_s(self) -> float:
        return self.n_frames / self.fps

    def colour_index(self, frame: int) -> int:
        """Index into ``colours`` shown at ``frame``."""
        if not 0 <= frame < self.n_frames:
            raise IndexError(f"frame {frame} outside [0, {self.n_frames})")
        return frame * len(self.colours) // self.n_frames

    @property
    def caption(self) -> str:
        """'a square that is red, then blue, then green' (+ '; beeps: low, high' when it beeps)."""
        head = f"a {self.shape.kind} that is {self.colours[0]}"
        text = head + "".join(f", then {c}" for c in self.colours[1:])
        return text + ("; beeps: " + ", ".join(b.pitch for b in self.beeps) if self.beeps else "")

    def to_json(self) -> dict[str, Any]:
        shape = self.shape.to_json()
        del shape["colour"]
        return {"width": self.width, "height": self.height, "fps": self.fps,
                "n_frames": self.n_frames, "duration_s": self.duration_s, "gray": self.gray,
                "format": self.format, "colours": list(self.colours), **shape,
                **({"sample_rate": self.sample_rate, "beeps": [b.to_json() for b in self.beeps]}
                   if self.beeps else {})}


# --- audio items -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BeepSpec:
    """One sine beep starting ``start_s`` seconds into the clip."""

    pitch: str
    start_s: float
    length_s: float
    amplitude: float

    def __post_init__(self) -> None:
        _check_choice("pitch", self.pitch, PITCHES)
        if self.length_s <= 2 * BEEP_FADE_S:
            raise ValueError(f"a beep must outlast its two {BEEP_FADE_S}s fades, got {self.length_s}s")

    @property
    def freq_hz(self) -> float:
        return PITCHES[self.pitch]

    def to_json(self) -> dict[str, Any]:
        return {"pitch": self.pitch, "freq_hz": self.freq_hz, "start_s": self.start_s,
                "length_s": self.length_s, "amplitude": self.amplitude}


@dataclass(frozen=True)
class AudioSpec:
    """Beeps separated by gaps, with leading/trailing silence::

        | lead | beep1 | gap | beep2 | ... | beepN | trail |
    """

    sample_rate: int
    channels: int
    beeps: tuple[BeepSpec, ...]
    duration_s: float
    format: str

    def __post_init__(self) -> None:
        _check_choice("audio format", self.format, AUDIO_FORMATS)
        if self.sample_rate not in AUDIO_SAMPLE_RATES:
            raise ValueError(f"sample rate must be one of {AUDIO_SAMPLE_RATES}, got {self.sample_rate}")
        if self.format == "opus" and self.sample_rate != OPUS_SAMPLE_RATE:
            raise ValueError(f"Opus files are {OPUS_SAMPLE_RATE} Hz, got {self.sample_rate}")
        if self.channels not in (1, 2):
            raise ValueError(f"channels must be 1 or 2, got {self.channels}")
        lo, hi = BEEP_COUNT_RANGE
        if not lo <= len(self.beeps) <= hi:
            raise ValueError(f"an audio clip has {lo}-{hi} beeps, got {len(self.beeps)}")
        for a, b in zip(self.beeps, self.beeps[1:]):
            if b.start_s < a.start_s + a.length_s:
                raise ValueError(f"beeps overlap or are out of order: {a} then {b}")
        if self.beeps[0].start_s < 0 or self.beeps[-1].start_s + self.beeps[-1].length_s > self.duration_s:
            raise ValueError(f"beeps must lie inside the {self.duration_s:.3f}s clip")

    @property
    def caption(self) -> str:
        """'beeps: low, high, high'."""
        return "beeps: " + ", ".join(b.pitch for b in self.beeps)

    def to_json(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "channels": self.channels,
                "duration_s": self.duration_s, "format": self.format,
                "beeps": [b.to_json() for b in self.beeps]}
