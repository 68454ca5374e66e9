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
from typing import Any, Literal

import torch

from encoders.audio.mimo_config import TOKENIZER_ATTENTION
from llm_core.engine.engine_config import EngineConfig
from llm_core.model.dtype import parse_dtype
from llm_core.storage import RedisAddress
from mm_pipeline.encode.batcher import BatcherConfig
from mm_pipeline.encode.plan import PlannerConfig
from mm_pipeline.media.decode.backend import BACKENDS as DECODE_BACKENDS
from mm_pipeline.media.decode.decoder_memory import shared_codec_threads
from mm_pipeline.media.ingest_config import IngestConfig, MediaLimits
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.prompt.template_source import load_chat_template

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
# OmniEngineConfig's nested configs whose fields also have flat names "<prefix>_<field>" (from_kwargs,
# CLI flags): MediaLimits and VideoSamplingParams share field names (max_frames), hence the prefixes.
NESTED_CONFIGS: dict[str, tuple[str, type]] = {"limits": ("media", MediaLimits),
                                               "video_sampling": ("video", VideoSamplingParams)}
_FLAT_NESTED = {f"{prefix}_{f.name}": (group, f.name)
                for group, (prefix, part) in NESTED_CONFIGS.items() for f in dataclasses.fields(part)}


def _thread_count(name: str, value: int | str | None, least: int, none: bool = True) -> int | str | None:
    """An intra-op thread setting: "auto", None (where ``none``), or a count >= ``least`` (int, or its digits)."""
    if value == "auto" or (value is None and none):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be auto{', none' if none else ''} or an integer >= {least}, got {value!r}")
    return value


class CheckpointMismatchError(ValueError):
    """An engine setting the checkpoint cannot run with, known only once its config is read (the
    settings alone were fine): the CLI reports it as it reports a bad flag."""


@dataclass(frozen=True)
class OmniEngineConfig:
    # model placement
    device: str = "cpu"
    """cpu, cuda, cuda:1 ..."""
    encoder_device: str | None = None
    """Device of the vision / audio encoders (none: device); e.g. cuda:2 beside an LLM on cuda:0-1 (tensor-parallel 2)."""
    dtype: str | torch.dtype = "float32"
    """Model dtype: float32, bfloat16 (bf16) or float16 (fp16) (llm_core.model.dtype.parse_dtype)."""
    # the LLM engine: KV pools, chunking, scheduling, prefix cache and its KV tiers
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The LLM engine's config (its fields are flags under their own names)."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the checkpoint's: a file, or the template inline (vLLM's --chat-template)."""
    # held as the template's text (a path is read here), so a config sent to another process or
    # machine -- a Ray replica -- carries the template itself, not a path that may not exist there
    # media ingest
    limits: MediaLimits = field(default_factory=MediaLimits)
    """Size, pixel, duration and frame limits of one media item (flags --media-*)."""
    allowed_local_dirs: tuple[str, ...] = ()
    """Directory whose files file:// media URLs may read (repeatable; none: no local files)."""
    allow_http: bool = False
    """Fetch http(s) media URLs (from allowed_domains only)."""
    allowed_domains: tuple[str, ...] = ()
    """Host (and its subdomains) remote media may come from (repeatable)."""
    fetch_timeout_s: float = 10.0
    """Time limit of one remote media fetch, redirects included."""
    allow_private_hosts: bool = False
    """Let allowed media domains resolve to loopback/private addresses (an internal media host; off: only public addresses)."""
    decode_while_receiving: bool = True
    """Decode an http(s) video (fragmented or moov-first MP4, WebM/Matroska, Ogg) while its bytes still arrive."""
    fetch_index_from_end: bool = True
    """Decode an http(s) MP4 whose index (moov) follows its samples while it arrives too: the index is fetched first by an HTTP range request for the end of the file (a host that does not answer it exactly: decoded after arrival)."""
    # video sampling and streaming granularity
    video_sampling: VideoSamplingParams | None = None
    """Video frame sampling (flags --video-*; default: the checkpoint's processor_config)."""
    video_audio: bool | None = None
    """Hear videos: a video's sound track is laid out with its frames, interleaved by time (models with an audio encoder; none: the checkpoint's processor_config.use_audio_in_video, true when absent)."""
    groups_per_chunk: int = 1
    """Video frame groups one decoder decodes before they go to the encoder; a chunk takes in more when the next one would decode at least its own frames again from its seek point (1: the encoder starts as soon as the first group is decoded)."""
    # True: the LLM request starts at once and prefill follows the units as they arrive; False:
    # prefill starts only when every unit of the request is encoded (same tokens, later TTFT).
    stream_embeddings: bool = True
    """Start prefill while media units are still being encoded (same tokens, earlier first token)."""
    stream_min_tokens: int = 256
    """Streamed prefill waits until at least this many more prompt tokens have their rows (or all have; once fewer rows are still missing, until that many): fewer, larger steps; each step costs a fixed overhead and competes with decoding for the CPU, while rows held back at the end land in the step the first token waits for (0: step on every arrival)."""
    # encoder cache tiers: memory (always), disk (when cache_dir is set), Redis (when redis_url is set)
    cache_memory_bytes: int = 1 << 30
    """Encoder cache: memory tier budget in bytes."""
    cache_dir: str | None = None
    """Encoder cache: disk tier directory (none: no disk tier)."""
    cache_disk_bytes: int | None = 8 << 30
    """Encoder cache: disk tier byte cap, least recently used entries go first (none: no cap)."""
    redis_url: str | None = None
    """Encoder cache: shared Redis tier, redis://[[user]:password@]host[:port][/db] (none: off)."""
    audio_tokenizer_attention: Literal["reference", "bidirectional"] = "reference"
    """MiMo-V2.5 audio tokenizer attention: reference (causal, sliding layers see 128 frames back) or bidirectional (sglang's reading: all full)."""
    # encoder batching
    encoder_vision_budget: int = 16384
    """Vision encoder: patch rows batched into one forward."""
    encoder_audio_budget: int = 24000
    """Audio encoder: mel frames batched into one forward."""
    encoder_max_wait_ms: float = 5.0
    """How long the oldest pending encoder job may wait for company, in milliseconds."""
    encoder_batch_order: Literal["fair", "arrival"] = "fair"
    """Encoder queue order: fair (requests take turns, the more urgent priority first; on a CPU encoder a new request's units are batched apart from those of requests already encoding and from a new request with more rows queued, so an image does not wait for a video's frame groups) or arrival (one queue in priority, then arrival order)."""
    # The encoder on its own worker (a thread; on CUDA its own stream) so encoding of later frame
    # groups overlaps prefill of earlier ones; False runs encoder batches on the engine thread
    # between LLM steps (same tokens). runtime/encoder_worker.py.
    encoder_worker: bool = True
    """Run the encoder on its own worker thread (CUDA: its own stream) beside the LLM steps."""
    encoder_threads: int | str | None = "auto"
    """CPU intra-op threads of the encoder worker: auto (one per lane beside a CPU LLM with llm_threads auto, whose engine thread owns the process's one wide OpenMP team; otherwise measured at start: 1 or every CPU, whichever runs a frame group through the vision tower faster), N (with llm_threads auto the engine thread keeps the rest), 0 (the CPUs the busy decode workers leave, re-read per batch) or none (torch's setting)."""
    llm_threads: int | str | None = "auto"
    """CPU intra-op threads of the engine thread (LLM steps): auto (measured at start: 1 or every CPU, whichever runs a prefill probe faster; the winner runs steps of llm_team_min_rows rows or more while no decode worker, encoder lane or other process holds a core, other steps run at 1), N (every step), or none (torch's setting)."""
    llm_team_min_rows: int | str = "auto"
    """With llm_threads auto: the fewest rows of a step that runs on the engine thread's team of every CPU: auto (measured at start: scratch prefills of 128 and 32 rows at 1 thread and on the team; from 16 rows when the team wins at both, from 128 when only there, else from 256, where the team won the llm_threads probe) or N."""
    encoder_lanes: int = 2
    """Encoder worker threads running batches side by side on a CPU encoder, each taking its share of the queue, lanes beyond the first only while the decode workers leave them a CPU; the encoder's intra-op share (encoder_threads; auto: measured on the first lane) is divided among them: the frame groups left when decoding ends encode on every core at once (1: one encoder thread; a CUDA encoder has one, its own stream)."""
    warm_up: bool = True
    """CPU LLM: one scratch prefill of max_num_batched_tokens rows (at most 512) on the engine thread at start (no request, counter or cache entry), so the allocator's heap grows then and not inside the first long request."""
    # admission and decode workers
    max_queue: int = 256
    """Requests in flight before new ones are refused (HTTP 429)."""
    decode_workers: int = 2
    """Media decode workers: threads, or with decode_backend process as many worker processes."""
    # thread: decode on the worker threads (PyAV/PIL drop the GIL); process: video chunks and image
    # pixels decode in worker processes, frames handed back through shared memory
    # (media/decode/backend.py). The default is the measured winner (README "pipeline").
    decode_backend: Literal["thread", "process"] = "thread"
    """Where video chunks and image pixels decode: worker threads or worker processes (shared-memory hand-off)."""
    decoder_threads: int = 0
    """FFmpeg's own threads per video decoder, outside the GIL (0: the CPUs shared out among the decode workers, 1: none)."""
    decode_spare_workers: int = 1
    """Extra media worker threads that take only calls of requests with none running, so one request's long video never makes another's media wait for a worker (0: none)."""
    decode_queue: int = 256
    """Media decode calls admitted beyond the busy threads; further callers wait for a slot."""
    decode_admit_timeout_s: float | None = 30.0
    """How long a media decode call may wait for a slot before HTTP 503 (none: no limit)."""

    def __post_init__(self) -> None:
        for name in ("device", "encoder_device"):  # checked now, not as torch's error once the model loads
            value = getattr(self, name)
            try:
                if value is not None:
                    torch.device(value)
            except (RuntimeError, TypeError):
                raise ValueError(f"{name} must be a device such as cpu, cuda or cuda:1, got {value!r}") from None
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))
        if self.stream_min_tokens < 0:
            raise ValueError(f"stream_min_tokens must be >= 0, got {self.stream_min_tokens}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend must be one of {DECODE_BACKENDS}, got {self.decode_backend!r}")
        if self.decoder_threads < 0:
            raise ValueError(f"decoder_threads must be >= 0, got {self.decoder_threads}")
        if self.decode_workers < 1 or self.decode_queue < 0 or self.decode_spare_workers < 0:
            raise ValueError(f"decode_workers must be >= 1, decode_queue and decode_spare_workers >= 0, got "
                             f"{self.decode_workers}, {self.decode_queue}, {self.decode_spare_workers}")
        if self.cache_memory_bytes < 0:
            raise ValueError(f"cache_memory_bytes must be >= 0, got {self.cache_memory_bytes}")
        parse_dtype(self.dtype)  # ValueError naming the accepted spellings
        if self.redis_url is not None:
            RedisAddress.from_url(self.redis_url)  # raises ValueError naming what is wrong
        if self.audio_tokenizer_attention not in TOKENIZER_ATTENTION:
            raise ValueError(f"audio_tokenizer_attention must be one of {TOKENIZER_ATTENTION}, got "
                             f"{self.audio_tokenizer_attention!r}")
        # the command line spells a count as text ("2"); the field holds the int
        object.__setattr__(self, "encoder_threads", _thread_count("encoder_threads", self.encoder_threads, 0))
        object.__setattr__(self, "llm_threads", _thread_count("llm_threads", self.llm_threads, 1))
        object.__setattr__(self, "llm_team_min_rows",
                           _thread_count("llm_team_min_rows", self.llm_team_min_rows, 1, none=False))
        if self.encoder_lanes < 1:
            raise ValueError(f"encoder_lanes must be >= 1, got {self.encoder_lanes}")
        if self.groups_per_chunk < 1:
            raise ValueError(f"groups_per_chunk must be >= 1, got {self.groups_per_chunk}")
        self.ingest_config, self.batcher_config  # validate the parts' configs

    @classmethod
    def from_kwargs(cls, **fields: Any) -> "OmniEngineConfig":
        """Flat field names -> the nested configs: ``EngineConfig`` names (page_size, max_num_seqs,
        kv_model_id...) go into ``engine`` (over an ``engine=`` given too), ``media_<field>`` into
        ``limits`` and ``video_<field>`` into ``video_sampling`` (over ``limits=`` /
        ``video_sampling=``, else over the defaults), the rest are this class's own. These are the
        CLI's flag names too (mm_pipeline/config_flags.py). ``TypeError`` names an unknown field."""
        own = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - own - _ENGINE_FIELDS - set(_FLAT_NESTED))
        if unknown:
            known = sorted(own | _ENGINE_FIELDS | set(_FLAT_NESTED))
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unknown OmniEngineConfig field {unknown[0]!r}{hint}: neither an "
                            f"OmniEngineConfig nor an EngineConfig field")
        engine_fields = {k: v for k, v in fields.items() if k in _ENGINE_FIELDS}
        rest = {k: v for k, v in fields.items() if k not in _ENGINE_FIELDS and k not in _FLAT_NESTED}
        engine = dataclasses.replace(rest.pop("engine", EngineConfig()), **engine_fields)
        for group, part in NESTED_CONFIGS.items():
            given = {_FLAT_NESTED[k][1]: v for k, v in fields.items() if _FLAT_NESTED.get(k, ("",))[0] == group}
            if given:
                rest[group] = dataclasses.replace(rest.get(group) or part[1](), **given)
        return cls(engine=engine, **rest)

    @property
    def ingest_config(self) -> IngestConfig:
        return IngestConfig(allowed_local_dirs=self.allowed_local_dirs, allow_remote=self.allow_http,
                            allowed_domains=self.allowed_domains, fetch_timeout_s=self.fetch_timeout_s,
                            allow_private_hosts=self.allow_private_hosts,
                            decode_while_receiving=self.decode_while_receiving,
                            fetch_index_from_end=self.fetch_index_from_end, limits=self.limits)

    @property
    def batcher_config(self) -> BatcherConfig:
        return BatcherConfig(self.encoder_vision_budget, self.encoder_audio_budget, self.encoder_max_wait_ms / 1000,
                             self.encoder_batch_order)

    def check_checkpoint(self, temporal_patch_size: int) -> None:
        """Raise ``CheckpointMismatchError`` for settings the checkpoint cannot run with. Frames are
        sampled in groups of ``video_sampling.frame_factor`` and patchified in groups of the vision
        tower's ``temporal_patch_size``: a factor that is not a multiple of it plans too few groups
        (a one-frame video with factor 1 on a temporal-patch-2 tower plans none, and its request
        fails) or silently drops frames. The checkpoint's own processor_config is checked by
        OmniConfig; this is the override (--video-frame-factor)."""
        if self.video_sampling is not None and self.video_sampling.frame_factor % temporal_patch_size:
            raise CheckpointMismatchError(
                f"video_frame_factor (--video-frame-factor) {self.video_sampling.frame_factor} is not a positive "
                f"multiple of the checkpoint's vision temporal_patch_size {temporal_patch_size}: frames are "
                f"encoded in groups of {temporal_patch_size}")

    @property
    def needs_vision(self) -> bool:
        """Whether requests may hold images or videos (--limit-mm-per-prompt): else the vision tower is not loaded."""
        return self.limits.allows("image") or self.limits.allows("video")

    @property
    def needs_audio(self) -> bool:
        """Whether requests may hold audio, an audio item or a video's sound track (--video-audio
        not off): else the audio encoder is not loaded."""
        return self.limits.allows("audio") or (self.limits.allows("video") and self.video_audio is not False)

    def planner_config(self, default_sampling: VideoSamplingParams, max_context_tokens: int | None = None,
                       default_video_audio: bool = True) -> PlannerConfig:
        video_audio = default_video_audio if self.video_audio is None else self.video_audio
        return PlannerConfig(self.limits, self.video_sampling or default_sampling, self.groups_per_chunk,
                             max_context_tokens, video_audio, self.resolved_decoder_threads, self.decode_workers)

    @property
    def resolved_decoder_threads(self) -> int:
        """``decoder_threads``, with 0 resolved to the CPUs per decode worker (media/decode/decoder_memory.py
        ``shared_codec_threads``: 1, i.e. none, with two workers on two CPUs)."""
        return self.decoder_threads or shared_codec_threads(self.decode_workers)
