"""What media ingest and decoding may accept: the byte, pixel, duration, frame and decoded-memory
limits (``MediaLimits``, enforced by ingest and by the decoders from headers, before any full decode)
and where ingest may read from (``IngestConfig``: local directories, remote hosts, fetch deadlines).
Kept apart from ``ingest.py`` so the decoders and configs that need only the limits do not import
the fetch machinery."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from llm_core.json_setting import json_object_setting
from mm_pipeline.media.types import MediaKind


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
    max_items_per_kind: str | None = None
    """JSON object of image, video, audio -> most items of that kind in one request (0: the kind is refused and its encoder not loaded; vLLM's --limit-mm-per-prompt)."""
    # held as canonical JSON text (a mapping given is turned into it) so the config stays hashable and
    # travels to Ray replicas as it is; ``per_kind`` is the parsed form. Flag --media-max-items-per-kind,
    # also spelled as vLLM's --limit-mm-per-prompt

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_duration_s", "max_frames", "max_media_items",
                     "max_request_decoded_bytes", "max_decoded_bytes_in_flight", "max_animation_pixels",
                     "decode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MediaLimits.{name} must be positive, got {getattr(self, name)}")
        if self.max_items_per_kind is not None:
            object.__setattr__(self, "max_items_per_kind", json.dumps(_per_kind(self.max_items_per_kind), sort_keys=True))

    @property
    def per_kind(self) -> dict[str, int]:
        """Kind name -> most items of it in one request (kinds not named: only max_media_items bounds them)."""
        return {} if self.max_items_per_kind is None else json.loads(self.max_items_per_kind)

    def allows(self, kind: str) -> bool:
        """Whether a request may hold ``kind`` at all (not limited to 0)."""
        return self.per_kind.get(kind, 1) > 0

    def check_items(self, kinds: Sequence[str | None]) -> str | None:
        """The problem with a request whose media items are of ``kinds`` (None: a part that names
        none, known after ingest), or None: more items than max_media_items, a kind over its limit."""
        if len(kinds) > self.max_media_items:
            return f"the request has {len(kinds)} media items, limit {self.max_media_items} (max_media_items)"
        return self.check_counts(Counter(k for k in kinds if k is not None))

    def check_counts(self, counts: Mapping[str, int]) -> str | None:
        """The problem with a request holding ``counts`` items per kind, or None: a kind over its
        per-prompt limit, a disabled kind named as such."""
        for kind, n in sorted(counts.items()):
            most = self.per_kind.get(kind)
            if most == 0 and n:
                return f"{kind} input is disabled on this server (--limit-mm-per-prompt {kind}: 0)"
            if most is not None and n > most:
                return (f"the request has {n} {kind} items, limit {most} per request "
                        f"(--limit-mm-per-prompt)")
        return None


MEDIA_KINDS = tuple(k.value for k in MediaKind)  # image, video, audio


def _per_kind(value: str | Mapping[str, int]) -> dict[str, int]:
    """``max_items_per_kind`` checked: a JSON object (or mapping) of known kinds to counts >= 0."""
    value = json_object_setting(value, "--limit-mm-per-prompt", known=MEDIA_KINDS, noun="kind",
                                example='{"image": 4, "video": 1}')
    out = {}
    for kind, n in value.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"--limit-mm-per-prompt: {kind} must be an integer >= 0, got {n!r}")
        out[kind] = n
    return out


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
