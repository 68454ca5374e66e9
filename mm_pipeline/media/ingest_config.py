"""What media ingest and decoding may accept: the byte, pixel, duration, frame and decoded-memory
limits (``MediaLimits``, enforced by ingest and by the decoders from headers, before any full decode)
and where ingest may read from (``IngestConfig``: local directories, remote hosts, fetch deadlines).
Kept apart from ``ingest.py`` so the decoders and configs that need only the limits do not import
the fetch machinery."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 128 << 20
    """Encoded size of one media item in bytes."""
    max_pixels: int = 64 << 20
    """Pixels of an image or a video frame, read from the header before decoding."""
    max_duration_s: float = 3600.0
    """Duration of an audio or video item in seconds."""
    max_frames: int = 216_000
    """Source frames of a video (its decode cost; 1 h at 60 fps)."""
    # Decoded-memory and decode-time budgets (README "Limits and security"), all checked from
    # headers before the pixels or samples they bound are decoded.
    max_media_items: int = 32
    """Media parts of one request."""
    max_request_decoded_bytes: int = 1 << 30
    """Decoded uint8 pixels + float32 samples of one request."""
    max_decoded_bytes_in_flight: int = 2 << 30
    """Decoded bytes held by all decodes of the server at once (a decode waits for room until its deadline)."""
    max_animation_pixels: int = 1 << 30
    """GIF/WebP: canvas pixels x frames composited (the canvas may grow)."""
    decode_timeout_s: float = 30.0
    """One media item's decode deadline in seconds, probe included (then HTTP 413)."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_duration_s", "max_frames", "max_media_items",
                     "max_request_decoded_bytes", "max_decoded_bytes_in_flight", "max_animation_pixels",
                     "decode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MediaLimits.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class IngestConfig:
    allowed_local_dirs: tuple[str, ...] = ()  # empty: no local file access
    allow_remote: bool = False
    allowed_domains: tuple[str, ...] = ()  # "example.com" allows it and its subdomains
    fetch_timeout_s: float = 10.0  # whole fetch, redirects included
    max_redirects: int = 3
    allow_private_hosts: bool = False  # let allowed domains resolve to loopback / private addresses
    decode_while_receiving: bool = True  # http(s) video/audio: decode while the body arrives (media.decode.early)
    fetch_index_from_end: bool = True  # an MP4 with its index last: fetch it by a range first (media.index_from_end)
    limits: MediaLimits = field(default_factory=MediaLimits)

    def __post_init__(self) -> None:
        if not self.fetch_timeout_s > 0 or self.max_redirects < 0:
            raise ValueError(f"IngestConfig needs fetch_timeout_s > 0 and max_redirects >= 0, got "
                             f"{self.fetch_timeout_s}, {self.max_redirects}")
