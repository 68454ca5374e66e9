"""OmniEngineConfig: every knob of the omni runtime in one frozen dataclass.

Groups: model placement, the LLM engine (``engine``: an llm_core ``EngineConfig``, every field of it
settable, none copied here), media ingest (limits, local dirs, remote fetch), video sampling and
streaming granularity, the encoder cache tiers, encoder batching, admission and the decode worker
pool. ``ingest_config`` / ``batcher_config`` / ``planner_config`` derive the configs of the other
parts; nothing here is mutated after construction.

Call sites name fields flat -- ``OmniEngineConfig.from_kwargs(device="cuda", num_full_tokens=8192)``
-- and engine field names go into ``engine``.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_core.engine.llm_engine import EngineConfig
from llm_core.model.dtype import parse_dtype
from llm_core.storage import RedisAddress
from mm_pipeline.encode.batcher import BatcherConfig
from mm_pipeline.encode.plan import PlannerConfig
from mm_pipeline.media.ingest import IngestConfig, MediaLimits
from mm_pipeline.media.video_sampling import VideoSamplingParams

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclass(frozen=True)
class OmniEngineConfig:
    # model placement
    device: str = "cpu"
    dtype: str | torch.dtype = "float32"  # any spelling llm_core.model.dtype.parse_dtype takes ("bf16", ...)
    # the LLM engine: KV pools, chunking, scheduling, prefix cache and its KV tiers
    engine: EngineConfig = field(default_factory=EngineConfig)
    # media ingest
    limits: MediaLimits = field(default_factory=MediaLimits)
    allowed_local_dirs: tuple[str, ...] = ()
    allow_http: bool = False
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    # video sampling and streaming granularity
    video_sampling: VideoSamplingParams | None = None  # None: the checkpoint's processor_config
    groups_per_chunk: int = 2
    # True: the LLM request starts at once and prefill follows the units as they arrive; False:
    # prefill starts only when every unit of the request is encoded (same tokens, later TTFT).
    stream_embeddings: bool = True
    # encoder cache tiers: memory (always), disk (when cache_dir is set), Redis (when redis_url is set)
    cache_memory_bytes: int = 1 << 30
    cache_dir: str | None = None
    cache_disk_bytes: int | None = None
    redis_url: str | None = None
    # encoder batching
    encoder_vision_budget: int = 16384
    encoder_audio_budget: int = 24000
    encoder_max_wait_ms: float = 5.0
    # admission and decode workers
    max_queue: int = 256
    decode_workers: int = 2
    decode_queue: int = 256
    decode_admit_timeout_s: float | None = 30.0  # waiting for a media worker slot, then 503 (None: no limit)

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.decode_workers < 1 or self.decode_queue < 0:
            raise ValueError(f"decode_workers must be >= 1 and decode_queue >= 0, got "
                             f"{self.decode_workers}, {self.decode_queue}")
        if self.cache_memory_bytes < 0:
            raise ValueError(f"cache_memory_bytes must be >= 0, got {self.cache_memory_bytes}")
        parse_dtype(self.dtype)  # ValueError naming the accepted spellings
        if self.redis_url is not None:
            RedisAddress.from_url(self.redis_url)  # raises ValueError naming what is wrong
        if self.groups_per_chunk < 1:
            raise ValueError(f"groups_per_chunk must be >= 1, got {self.groups_per_chunk}")
        self.ingest_config, self.batcher_config  # validate the parts' configs

    @classmethod
    def from_kwargs(cls, **fields: Any) -> "OmniEngineConfig":
        """Flat field names -> the nested configs: ``EngineConfig`` names (page_size, max_num_seqs,
        kv_model_id...) go into ``engine`` (over an ``engine=`` given too), the rest are this
        class's own. ``TypeError`` names a field that is neither."""
        own = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - own - _ENGINE_FIELDS)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(own | _ENGINE_FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unknown OmniEngineConfig field {unknown[0]!r}{hint}: neither an "
                            f"OmniEngineConfig nor an EngineConfig field")
        engine_fields = {k: v for k, v in fields.items() if k in _ENGINE_FIELDS}
        rest = {k: v for k, v in fields.items() if k not in _ENGINE_FIELDS}
        engine = dataclasses.replace(rest.pop("engine", EngineConfig()), **engine_fields)
        return cls(engine=engine, **rest)

    @property
    def ingest_config(self) -> IngestConfig:
        return IngestConfig(allowed_local_dirs=self.allowed_local_dirs, allow_remote=self.allow_http,
                            allowed_domains=self.allowed_domains, fetch_timeout_s=self.fetch_timeout_s,
                            limits=self.limits)

    @property
    def batcher_config(self) -> BatcherConfig:
        return BatcherConfig(self.encoder_vision_budget, self.encoder_audio_budget, self.encoder_max_wait_ms / 1000)

    def planner_config(self, default_sampling: VideoSamplingParams, max_context_tokens: int | None = None
                       ) -> PlannerConfig:
        return PlannerConfig(self.limits, self.video_sampling or default_sampling, self.groups_per_chunk,
                             max_context_tokens)
