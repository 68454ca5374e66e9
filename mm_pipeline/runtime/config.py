"""OmniEngineConfig: every knob of the omni runtime in one frozen dataclass.

Groups: the LLM engine (pools, chunking, prefix cache), media ingest (limits, local dirs, remote
fetch), video sampling and streaming granularity, the encoder cache tiers, encoder batching,
admission and the decode worker pool. ``engine_config`` / ``ingest_config`` derive the configs of
the parts; nothing here is mutated after construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_core.engine.llm_engine import EngineConfig
from llm_core.storage import RedisAddress
from mm_pipeline.encode.batcher import BatcherConfig
from mm_pipeline.media.ingest import IngestConfig, MediaLimits
from mm_pipeline.encode.planner import PlannerConfig
from mm_pipeline.media.video_sampling import VideoSamplingParams


@dataclass(frozen=True)
class OmniEngineConfig:
    # model placement
    device: str = "cpu"
    dtype: str = "float32"
    # LLM engine (llm_core.EngineConfig fields; prefix cache and its KV tiers included)
    page_size: int = 16
    num_full_tokens: int | None = None
    num_swa_tokens: int | None = None
    memory_fraction: float = 0.5
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_chunk_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    prefix_checkpoint_every: int = 0
    kv_host_bytes: int = 0
    kv_store: str | None = None
    queue_policy: str = "fcfs"
    seed: int = 0
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
    decode_admit_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.decode_workers < 1 or self.decode_queue < 0:
            raise ValueError(f"decode_workers must be >= 1 and decode_queue >= 0, got "
                             f"{self.decode_workers}, {self.decode_queue}")
        if self.cache_memory_bytes < 0:
            raise ValueError(f"cache_memory_bytes must be >= 0, got {self.cache_memory_bytes}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.redis_url is not None:
            RedisAddress.from_url(self.redis_url)  # raises ValueError naming what is wrong
        if self.groups_per_chunk < 1:
            raise ValueError(f"groups_per_chunk must be >= 1, got {self.groups_per_chunk}")
        self.engine_config, self.ingest_config, self.batcher_config  # validate the parts' configs

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            page_size=self.page_size, num_full_tokens=self.num_full_tokens, num_swa_tokens=self.num_swa_tokens,
            memory_fraction=self.memory_fraction, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, max_chunk_tokens=self.max_chunk_tokens,
            max_model_len=self.max_model_len, seed=self.seed, enable_prefix_caching=self.enable_prefix_caching,
            prefix_checkpoint_every=self.prefix_checkpoint_every, kv_host_bytes=self.kv_host_bytes,
            kv_store=self.kv_store, queue_policy=self.queue_policy,
        )

    @property
    def ingest_config(self) -> IngestConfig:
        return IngestConfig(allowed_local_dirs=self.allowed_local_dirs, allow_remote=self.allow_http,
                            allowed_domains=self.allowed_domains, fetch_timeout_s=self.fetch_timeout_s,
                            limits=self.limits)

    @property
    def batcher_config(self) -> BatcherConfig:
        return BatcherConfig(self.encoder_vision_budget, self.encoder_audio_budget, self.encoder_max_wait_ms / 1000)

    def planner_config(self, default_sampling: VideoSamplingParams) -> PlannerConfig:
        return PlannerConfig(self.limits, self.video_sampling or default_sampling, self.groups_per_chunk)
