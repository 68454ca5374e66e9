r"""Where a media item lives in the encoder cache: its media key, its units' keys, and the manifest
that records their layout, so that a repeat is planned without opening the media.

    content key + the kind's params (image processing; video: + sampling, sound) + encoder id
        ─► media key (salted: a request's cache_salt) ─┬─► image: one unit, keyed by the media key
                                                        ├─► video: a key per frame group, then one
                                                        │          per segment of its sound track
                                                        ├─► audio: a key per segment
                                                        └─► "manifest:<media key>": the layout

    manifest: float64, one row per unit in plan order (a video's groups, then its sound's segments)
        tokens │ timestamp (a video group's first frame, else 0) │ 1: a sound segment │ decoded bytes
                                                                                      (the item's, every row)

``MediaPlanner`` (planner.py) reads the manifest before anything else: a hit gives the plan's unit
keys, sizes, timestamps and decoded-bytes estimate with no probe or decode; a miss plans the media
from its bytes and writes the manifest here. Keys are content hashes (media/content_hash.py): an
entry never changes, it can only be missing.
"""

from __future__ import annotations

from typing import Any

import torch

from encoders.config import AudioConfig
from encoders.image_processing import ImageProcessingConfig
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.plan import MediaPlan, UnitPlan
from mm_pipeline.media.content_hash import (audio_segment_key, canonical_params, media_key, salted_media_key,
                                           video_group_key)
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.media.types import MediaItem, MediaKind


class CachedLayout:
    """The cache keys and manifests of media items under one encoder (``encoder_id``) and one
    preprocessing configuration, fixed for the planner's life. ``video_sound``: a video's sound
    track is laid out with its frames (a param of the video's media key)."""

    def __init__(self, cache: EncoderCache, image: ImageProcessingConfig, audio: AudioConfig | None,
                 sampling: VideoSamplingParams, encoder_id: str, video_sound: bool) -> None:
        self.cache = cache
        self.image = image
        self.audio = audio
        self.sampling = sampling
        self.encoder_id = encoder_id
        self.video_sound = video_sound
        self._param_forms: dict[MediaKind, bytes] = {}  # kind -> canonical_params(self._params(kind))

    # ---- keys -------------------------------------------------------------------------------
    def media_key(self, content: str, kind: MediaKind, salt: str | None = None) -> str:
        """The media key of content key ``content`` read as ``kind``, salted with ``salt``."""
        # the params of a kind are fixed for the planner's life: their canonical JSON once per kind
        # (a dict of them, normalised and dumped, was ~0.1 ms of every request's hop)
        form = self._param_forms.get(kind)
        if form is None:
            form = self._param_forms[kind] = canonical_params(self._params(kind))
        return salted_media_key(media_key(content, kind, form, self.encoder_id), salt)

    def unit_key(self, kind: MediaKind, mkey: str, i: int) -> str:
        """Unit ``i`` of a ``kind`` item: its frame group (video) or segment (audio)."""
        if kind is MediaKind.IMAGE:
            return mkey
        if kind is MediaKind.VIDEO:
            return video_group_key(mkey, self.sampling, i)
        return audio_segment_key(mkey, self.audio, i)

    def sound_key(self, mkey: str, i: int) -> str:
        """Segment ``i`` of a video's sound track."""
        return audio_segment_key(mkey, self.audio, i)

    # ---- manifests --------------------------------------------------------------------------
    def read(self, item: MediaItem, mkey: str, *, count_miss: bool = True) -> MediaPlan | None:
        """``item``'s plan from its cached manifest: keys, sizes, timestamps and decoded bytes,
        without opening the media (no cached rows: the planner looks those up). None when the cache
        holds no manifest of that shape (missing or malformed: planned from the bytes and written
        again). ``count_miss`` off: a miss is not counted (a read the planning pass repeats)."""
        manifest = self.cache.get(_manifest_key(mkey), manifest=True, count_miss=count_miss)
        if manifest is None or manifest.ndim != 2 or manifest.shape[1] != 4 or manifest.shape[0] == 0:
            return None
        sound = [i for i, flag in enumerate(manifest[:, 2].tolist()) if flag]
        groups = manifest.shape[0] - len(sound)
        units = tuple(UnitPlan(self.unit_key(item.kind, mkey, i) if i < groups else self.sound_key(mkey, i - groups),
                               int(n)) for i, n in enumerate(manifest[:, 0].tolist()))
        stamps = tuple(manifest[:groups, 1].tolist()) if item.kind is MediaKind.VIDEO else ()
        return MediaPlan(item, mkey, units, stamps, audio_units=len(sound),
                         audio_per_second=self._sound_rate() if sound else 0.0,
                         decoded_bytes=int(manifest[0, 3]))

    def write(self, plan: MediaPlan) -> None:
        """Record ``plan``'s layout (planned from the media's bytes) as its manifest."""
        groups = len(plan.units) - plan.audio_units
        stamps = list(plan.timestamps or [0.0] * groups) + [0.0] * plan.audio_units
        table = torch.tensor([[u.num_tokens, t, float(i >= groups), plan.decoded_bytes] for i, (u, t) in
                              enumerate(zip(plan.units, stamps))], dtype=torch.float64)
        self.cache.put(_manifest_key(plan.media_key), table)

    # ---- internal helpers -------------------------------------------------------------------
    def _params(self, kind: MediaKind) -> dict[str, Any]:
        """Everything besides the bytes and the weights that changes this kind's encoder output (the
        config objects themselves: canonical_params reads them as their asdict and remembers that)."""
        if kind is MediaKind.IMAGE:
            return {"image": self.image}
        if kind is MediaKind.VIDEO:
            return {"image": self.image, "sampling": self.sampling, "sound": self.audio if self.video_sound else None}
        return {"audio": self.audio}

    def _sound_rate(self) -> float:
        assert self.audio is not None  # a manifest with sound segments was written by a planner that hears
        return self.audio.tokens_per_second


def _manifest_key(mkey: str) -> str:
    return f"manifest:{mkey}"
