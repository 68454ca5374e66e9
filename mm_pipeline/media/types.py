"""Typed values that flow through the media stages.

    MediaSource ──ingest──► MediaItem (raw bytes + sniffed format) ──decode──► Decoded{Image,Video,Audio}

Decoded pixels are uint8 RGB in HWC layout (what PIL and PyAV produce); resizing, normalising and
patchifying belong to ``encoders.image_processing``.  Decoded audio is mono float32 at the rate the
caller asked for.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class MediaKind(str, enum.Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


@dataclass(frozen=True)
class MediaSource:
    """Where a media item comes from: exactly one of ``data`` (uploaded bytes), ``url`` (``data:``,
    ``file://``, ``http(s)://``), ``path`` (a local file) or ``base64`` (a bare base64 payload: an
    ``input_audio`` part's ``data``, a ``file`` part's ``file_data``; decoded as a data URL's payload
    is, on a worker -- prefixing it to make a data URL copied its megabytes on the event loop,
    ~90 ms for a body at the 256 MB cap).  ``kind`` is what the request declared (e.g. an
    ``image_url`` part); ``None`` accepts whatever the content sniffs as.  ``origin``: how error
    messages name where ``data`` came from (the item's ``MediaItem.origin``; None: "upload")."""

    data: bytes | None = field(default=None, repr=False)
    url: str | None = None
    path: str | None = None
    kind: MediaKind | None = None
    base64: str | None = field(default=None, repr=False)
    origin: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("data", "url", "path", "base64") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"MediaSource needs exactly one of data/url/path/base64, got {given or 'none'}")


@dataclass(frozen=True)
class MediaItem:
    """One ingested item: raw encoded bytes whose type was sniffed from the content.

    ``format`` is the container/codec family (``"png"``, ``"mp4"``, ``"gif"``...), ``origin`` a short
    description of where it came from, for error messages and logs."""

    kind: MediaKind
    format: str
    data: bytes = field(repr=False)
    origin: str = "upload"
    content_key: str | None = None
    """blake3 of ``data`` when ingest computed it (before sniffing); None: planning hashes it."""
    early: Any = field(default=None, repr=False, compare=False)
    """The ``EarlyVideoDecode`` (with its sound track's ``EarlyAudioDecode``) or ``EarlyAudioDecode``
    that decoded this item while its bytes arrived (media.decode.early), or None; planning takes the
    samples, production the frames, a cache hit cancels it."""

    @property
    def nbytes(self) -> int:
        return len(self.data)


class DeferredMediaItem(MediaItem):
    """A MediaItem whose bytes are produced on first use of ``data``: ingest knew the content key
    and the sniffed type from memos (mm_pipeline/media/source_memo.py), so a repeat served from the
    encoder cache never decodes its data URL or reads its file. Built like a MediaItem with a
    ``load() -> bytes`` in place of the bytes; ``load`` runs at most once (thread-safe) and must
    return the bytes ``content_key`` was computed from, or raise a ``MediaError``."""

    @property
    def data(self) -> bytes:
        with self._deferred_lock:
            if self._deferred_bytes is None:
                self._set("_deferred_bytes", self._deferred_load())
            return self._deferred_bytes

    @data.setter
    def data(self, load: Callable[[], bytes]) -> None:  # the dataclass __init__ hands ``load`` here, once
        if not callable(load):
            raise TypeError(f"DeferredMediaItem takes a load() callable, got {type(load).__name__}")
        self._set("_deferred_load", load)
        self._set("_deferred_bytes", None)
        self._set("_deferred_lock", threading.Lock())

    @property
    def loaded(self) -> bool:
        """Whether ``data`` was needed (and produced)."""
        return self._deferred_bytes is not None

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # frozen: only these private slots change, and only here


@dataclass(frozen=True, eq=False)
class DecodedImage:
    pixels: torch.Tensor  # [H, W, 3] uint8 RGB
    source_format: str

    def __post_init__(self) -> None:
        p = self.pixels
        if p.dtype != torch.uint8 or p.dim() != 3 or p.shape[2] != 3:
            raise ValueError(f"DecodedImage wants [H, W, 3] uint8, got {tuple(p.shape)} {p.dtype}")

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """Sampled frames of a video.  ``frame_indices[k]`` is the source frame (presentation order) that
    ``frames[k]`` shows and ``timestamps[k]`` its time in seconds; a padded tail repeats the last
    index and timestamp (see ``video_sampling``)."""

    frames: torch.Tensor  # [T, H, W, 3] uint8 RGB
    frame_indices: tuple[int, ...]
    timestamps: tuple[float, ...]
    video_fps: float
    total_frames: int
    source_format: str

    def __post_init__(self) -> None:
        f = self.frames
        if f.dtype != torch.uint8 or f.dim() != 4 or f.shape[3] != 3:
            raise ValueError(f"DecodedVideo wants [T, H, W, 3] uint8, got {tuple(f.shape)} {f.dtype}")
        if not (f.shape[0] == len(self.frame_indices) == len(self.timestamps)):
            raise ValueError(
                f"DecodedVideo: {f.shape[0]} frames, {len(self.frame_indices)} indices, "
                f"{len(self.timestamps)} timestamps must agree"
            )

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


@dataclass(frozen=True, eq=False)
class DecodedAudio:
    samples: torch.Tensor  # [N] float32 mono
    sample_rate: int
    source_format: str

    def __post_init__(self) -> None:
        s = self.samples
        if s.dtype != torch.float32 or s.dim() != 1:
            raise ValueError(f"DecodedAudio wants [N] float32, got {tuple(s.shape)} {s.dtype}")
        if self.sample_rate <= 0:
            raise ValueError(f"DecodedAudio sample_rate must be positive, got {self.sample_rate}")

    @property
    def duration_s(self) -> float:
        return int(self.samples.shape[0]) / self.sample_rate
