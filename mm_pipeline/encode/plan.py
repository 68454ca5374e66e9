"""What planning produces and production consumes: a media item's units, their keys and sizes.

``MediaPlanner`` (planner.py) makes a :class:`MediaPlan`; ``UnitProducer`` (unit_producer.py) turns
its claimed units into encoder jobs; the prompt layout sizes placeholders from ``UnitPlan.num_tokens``.
Both modules import these types from here, so neither imports the other's module for them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from mm_pipeline.encode.held_inputs import HeldInputs
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.prompt.layout import MediaSlots


@dataclass(frozen=True)
class UnitPlan:
    key: str
    num_tokens: int


@dataclass
class MediaPlan:
    """One media item laid out: its units (an image has one, a video one per frame group, an audio
    clip one per segment; a video with sound its frame groups, then its sound's segments),
    video group timestamps, and cache hits."""

    item: MediaItem = field(repr=False)
    media_key: str
    units: tuple[UnitPlan, ...]
    timestamps: tuple[float, ...] = ()
    cached: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    delivered: set[int] = field(default_factory=set, repr=False)  # cached units already handed to their sinks
    inputs: dict[int, Any] = field(default_factory=dict, repr=False)  # preprocessed on the miss path
    # the decode budget's share of ``inputs`` (log-mels decoded at planning), until their jobs are
    # encoded or the tensors dropped (held_inputs module doc); shared by joined plans, as ``inputs``
    held: HeldInputs | None = field(default=None, repr=False)
    video: Any = None  # (probe info or None for animations, FrameSampling, resized size)
    decoded_bytes: int = 0  # estimated bytes its decode holds (the request's decoded-bytes budget)
    audio_units: int = 0  # a video with sound: its last ``audio_units`` units are sound segments
    audio_per_second: float = 0.0  # ... laid out by time at this many tokens per second
    # the request's flow and priority (one plan per request; media/flows.py): its encoder jobs take
    # their turns in the batcher's queue as the request's, the more urgent first
    flow: Hashable | None = None
    priority: int = 0

    def is_audio_unit(self, i: int) -> bool:
        """Is unit ``i`` an audio segment (of an audio item, or of a video's sound)?"""
        return self.kind is MediaKind.AUDIO or i >= len(self.units) - self.audio_units

    @property
    def kind(self) -> MediaKind:
        return self.item.kind

    @property
    def num_tokens(self) -> int:
        return sum(u.num_tokens for u in self.units)

    @property
    def slots(self) -> MediaSlots:
        """The placeholder sizes the prompt layout expands for this item."""
        sizes = tuple(u.num_tokens for u in self.units)
        if not self.audio_units:
            return MediaSlots(self.kind.value, sizes, self.timestamps)
        groups = len(sizes) - self.audio_units
        return MediaSlots(self.kind.value, sizes[:groups], self.timestamps, sizes[groups:], self.audio_per_second)


@dataclass(frozen=True)
class PlannerConfig:
    limits: MediaLimits = MediaLimits()
    video_sampling: VideoSamplingParams = VideoSamplingParams()
    groups_per_chunk: int = 1  # see OmniEngineConfig.groups_per_chunk
    max_context_tokens: int | None = None  # the LLM's context: media that cannot fit fails before decoding
    video_audio: bool = True  # lay a video's sound track out with its frames (when the model hears)
    decoder_threads: int = 0  # FFmpeg's own threads per video decoder (0: FFmpeg picks, 1: none)
    decode_workers: int = 2  # workers a video's chunks share (video_chunks.plan_chunks)

    def __post_init__(self) -> None:
        if self.groups_per_chunk < 1 or self.decode_workers < 1:
            raise ValueError(f"groups_per_chunk and decode_workers must be >= 1, got {self.groups_per_chunk}, "
                             f"{self.decode_workers}")
        if self.decoder_threads < 0:
            raise ValueError(f"decoder_threads must be >= 0, got {self.decoder_threads}")
