"""EngineConfig: every knob of the text engine in one frozen dataclass, and the pool sizes it implies.

The field docstrings are the help text of the generated CLI flags (mm_pipeline/config_flags.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from llm_core.engine.sampling.generation_config import parse_override
from llm_core.engine.queue_policy import QueuePolicy
from llm_core.engine.scheduler import SchedulerConfig
from llm_core.kvcache.dual_pool import KVLayout, PoolSizing, default_kv_budget_bytes, swa_tokens_needed

# Default periodic checkpoint interval, in pages (512 tokens at page_size 16). Media and message ends are
# checkpoints already; periodic ones serve prompts that branch inside a long message, whose recompute
# they bound to one interval, at one kept window per interval. `benchmarks/prefix_cache.py --served`
# (README, "Prefix caching by default") shows no difference between none, 128 and 512 on its traces
# (whose branches are all at message or media ends), so the interval is long: little SWA, bounded loss.
PREFIX_CHECKPOINT_PAGES = 32


@dataclass(frozen=True)
class EngineConfig:
    """Pool sizes (docs/kv_cache.md §1, "Sizing"): the SWA pool gets what ``max_num_seqs`` running
    requests and ``swa_checkpoint_reserve_windows`` kept windows need (``swa_tokens_needed``), the
    Full pool the rest of one byte budget -- ``kv_cache_bytes``, or by default a fixed space on CPU
    and ``memory_fraction`` of free memory on CUDA, there capped at what ``max_num_seqs`` requests of
    ``max_model_len`` tokens can use. ``num_full_tokens`` / ``num_swa_tokens`` override either pool;
    an explicit Full size without an SWA size still sizes SWA by the formula."""

    page_size: int = 16
    """Tokens per KV page (both pools; prefix-cache hits are whole pages)."""
    num_full_tokens: int | None = None
    """Full-attention KV pool size in tokens (default: the rest of the KV byte budget after SWA)."""
    num_swa_tokens: int | None = None
    """Sliding-window KV pool size in tokens (default: what max_num_seqs requests and the checkpoint reserve need)."""
    memory_fraction: float = 0.5
    """CUDA, with kv_cache_bytes unset: share of the device's free memory the two KV pools take."""
    max_num_batched_tokens: int = 2048
    """Token budget of one model step (prefill chunks and decodes together)."""
    max_num_seqs: int = 64
    """Requests running (decoded) together."""
    max_chunk_tokens: int | None = None
    """Most new tokens of one request in one step (chunked prefill; default: the step budget)."""
    max_model_len: int | None = None
    """Context limit in tokens (default: the model's max_position_embeddings)."""
    swa_release_interval: int = 16
    """Decoded tokens between releases of sliding-window pages behind the window."""
    seed: int = 0
    """Seed of the sampler's generator for requests without their own seed."""
    # prefix cache (llm_core/kvcache/swa_radix_cache.py) and its tiers (llm_core/kvcache/tiers/, docs/kv_cache.md)
    enable_prefix_caching: bool = True
    """Reuse the KV of earlier prompts' shared prefixes, kept at media and message ends (docs/kv_cache.md)."""
    prefix_checkpoint_every: int | None = None
    """Also keep sliding-window KV every N tokens (a multiple of page_size; 0: off; none: every 32 pages)."""
    prefix_checkpoints_per_request: int = 32
    """Most media / message ends of one prompt where the prefix cache keeps a window: the first and the last ones (0: none)."""
    kv_host_bytes: int = 0
    """L2: host-memory KV tier budget in bytes (0: no L2)."""
    kv_store: str | None = None
    """L3: a directory, or redis://host:port/db (none: no L3)."""
    kv_model_id: str | None = None
    """L3 key namespace (default: a fingerprint of the model's weights)."""
    queue_policy: str = "fcfs"
    """Admission order: fcfs, fewest_uncached (prefix-cache aware) or priority (each request's priority, lower first; may preempt)."""
    queue_wait_credit: float = 1000.0
    """fewest_uncached: tokens of priority a waiting request gains per second."""
    kv_store_bytes: int | None = 8 << 30
    """L3 directory store: byte cap, least recently used pages go first (none: no cap; Redis: its maxmemory)."""
    kv_l3_load_timeout_s: float = 1.0
    """How long a request waits (not scheduled) for its cached prefix from L3 before it goes on with what arrived."""
    kv_cache_bytes: int | None = None
    """KV bytes of both pools (none: 4 GiB on CPU, memory_fraction on CUDA, capped at what the model can use)."""
    swa_checkpoint_reserve_windows: int = 128
    """With prefix caching: SWA pool room for this many windows the cache keeps (checkpoints; evicted LRU)."""
    # parallelism (llm_core/distributed/, docs/parallelism.md): one process per rank, rank 0 schedules
    tensor_parallel_size: int = 1
    """Ranks (GPUs) the attention heads, dense MLP and vocabulary are split over (1: one process)."""
    expert_parallel_size: int = 1
    """Ranks the MoE experts are partitioned over (1: every rank holds every expert, or its tensor-parallel slice)."""
    distributed_timeout_s: float = 600.0
    """Seconds a model collective may wait for the other ranks before the engine fails (a rank gone)."""
    fp8_experts: bool | None = None
    """Keep the routed experts as block-FP8 values and block factors, read as stored by the Triton expert kernels (half of bf16's bytes): an FP8 checkpoint's as stored, a float one's quantised at load in 128 x 128 blocks (none: on for an FP8 checkpoint on a GPU of compute capability 8.9+, which Triton's e4m3 needs; on CPU they are dequantised per call, for checks)."""
    # speculative decoding with the checkpoint's MTP layers (llm_core/engine/speculative/, docs/speculative.md)
    speculative_tokens: int | None = None
    """MTP draft tokens verified per decode step (0: off; none: 3 when the checkpoint has MTP layers, in one process; 0 under tensor / expert parallelism until a multi-GPU run has checked it)."""
    speculative_layers: str = "first"
    """Which MTP layer drafts step s: first (layer 0 every step, as vLLM / sglang) or chain (layer s)."""
    speculative_adaptive: bool = True
    """Choose each request's draft tokens from its recent acceptance and the batch size (down to 0)."""
    # fixed-shape decode steps per batch bucket (llm_core/engine/fixed_decode/decode_graphs.py)
    compile_decode: bool | None = None
    """Decode steps as fixed-shape graphs per batch bucket: torch.compile on CPU, CUDA graphs on CUDA (none: on for CUDA only)."""
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Batch sizes of the fixed-shape decode steps (a batch pads up to the next; larger batches run eagerly)."""
    native_cpu_kernels: bool = True
    """On CPU: C kernels compiled for this machine on first use where they beat torch (kernels/native/); off: torch only."""
    huge_pages: bool = True
    """On CPU: the weights and the KV pool on 2 MB transparent huge pages (kernels/cpu/huge_pages.py; fewer TLB misses when a step streams them)."""
    persistent_decode_batch: bool = True
    """Advance last decode step's inputs by one token when the step's requests are unchanged instead of rebuilding them (llm_core/engine/decode_batch_state.py)."""
    # structured outputs (llm_core/engine/structured/): response_format json, vLLM's structured_outputs
    structured_outputs_backend: Literal["xgrammar", "none"] = "xgrammar"
    """Grammar library that holds outputs to a JSON schema / regex / choice / grammar (none: such requests are refused)."""
    grammar_compile_timeout_s: float = 10.0
    """Longest a constraint may take to compile (in a worker process, killed past it) before its request is refused."""
    # default sampling of requests that leave a field unset (llm_core/engine/sampling/generation_config.py)
    generation_config: str = "auto"
    """Sampling defaults: auto (the checkpoint's generation_config.json), vllm or none (built-in ones), or a folder holding a generation_config.json."""
    override_generation_config: str | None = None
    """JSON object of temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens laid over those defaults."""

    def __post_init__(self) -> None:
        # before anything divides by it (the SWA pool's size is rounded up to whole pages)
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        # a pool holds whole pages, at least one (a model without sliding layers has no SWA pool: 0)
        if self.num_full_tokens is not None and self.num_full_tokens < self.page_size:
            raise ValueError(f"num_full_tokens must be at least one page ({self.page_size} tokens), "
                             f"got {self.num_full_tokens}")
        if self.num_swa_tokens is not None and self.num_swa_tokens < 0:
            raise ValueError(f"num_swa_tokens must be >= 0, got {self.num_swa_tokens}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self.scheduler_config  # validates the scheduler fields
        self.queue  # validates the queue policy
        if self.kv_host_bytes < 0:
            raise ValueError(f"kv_host_bytes must be >= 0, got {self.kv_host_bytes}")
        if not self.kv_l3_load_timeout_s >= 0:
            raise ValueError(f"kv_l3_load_timeout_s must be >= 0, got {self.kv_l3_load_timeout_s}")
        if self.kv_store_bytes is not None and self.kv_store_bytes < 0:
            raise ValueError(f"kv_store_bytes must be >= 0 or None, got {self.kv_store_bytes}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1 or None, got {self.kv_cache_bytes}")
        if self.speculative_tokens is not None and not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"speculative_tokens must be in [0, 16] or None, got {self.speculative_tokens}")
        if self.speculative_layers not in ("first", "chain"):
            raise ValueError(f"speculative_layers must be first or chain, got {self.speculative_layers!r}")
        if self.prefix_checkpoints_per_request < 0:
            raise ValueError(f"prefix_checkpoints_per_request must be >= 0, got {self.prefix_checkpoints_per_request}")
        if self.swa_checkpoint_reserve_windows < 0:
            raise ValueError(f"swa_checkpoint_reserve_windows must be >= 0, got {self.swa_checkpoint_reserve_windows}")
        self._validate_parallel()
        if self.structured_outputs_backend not in ("xgrammar", "none"):
            raise ValueError(f"structured_outputs_backend must be xgrammar or none, got {self.structured_outputs_backend!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be auto, vllm, none or a folder, got {self.generation_config!r}")
        if self.override_generation_config is not None:
            # checked now (a usage error at start-up); a mapping (a YAML config file's) is kept as JSON
            object.__setattr__(self, "override_generation_config",
                               json.dumps(parse_override(self.override_generation_config)))
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if not self.decode_buckets or any(b < 1 for b in self.decode_buckets):
            raise ValueError(f"decode_buckets must be batch sizes >= 1, got {self.decode_buckets}")
        if self.prefix_checkpoint_every is not None and (
                self.prefix_checkpoint_every < 0 or self.prefix_checkpoint_every % self.page_size):
            raise ValueError(f"prefix_checkpoint_every must be 0 or a positive multiple of page_size "
                             f"{self.page_size}, got {self.prefix_checkpoint_every}")

    @property
    def world_size(self) -> int:
        """Processes of one engine: max(tensor_parallel_size, expert_parallel_size)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def _validate_parallel(self) -> None:
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp < 1 or ep < 1:
            raise ValueError(f"tensor_parallel_size and expert_parallel_size must be >= 1, got {tp} and {ep}")
        if tp not in (1, self.world_size) or self.world_size % ep:
            raise ValueError(f"tensor_parallel_size {tp} with expert_parallel_size {ep}: tp must be 1 or "
                             f"max(tp, ep), and ep must divide it")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.world_size > 1 and (self.kv_host_bytes or self.kv_store):
            # tier copies move pages of rank 0's pools only; each rank would need its own tiers
            raise ValueError("kv_host_bytes / kv_store (KV tiers) are not supported with tensor or expert "
                             "parallelism yet; leave them unset")

    def decode_mode(self, device: torch.device | str) -> str | None:
        """How decode steps run on ``device``: "compile" (CPU) / "cudagraph" (CUDA) when fixed-shape
        steps are on, None for the plain path. Default: on for CUDA only -- on CPU the compiled step
        did not pay for its compile time (README, "Compiled decode steps")."""
        cuda = torch.device(device).type == "cuda"
        on = self.compile_decode if self.compile_decode is not None else cuda
        if self.world_size > 1:
            # a rank group: CUDA graphs on every rank only when asked for (--compile-decode) until a
            # multi-GPU run has checked them; torch.compile'd steps are not mirrored at all
            return "cudagraph" if cuda and self.compile_decode is True else None
        if not on:
            return None
        return "cudagraph" if cuda else "compile"

    @property
    def mtp_tokens(self) -> int | None:
        """``speculative_tokens`` as the engine takes it: none (3 when the checkpoint has MTP layers)
        becomes 0 for a rank group, where MTP is on only when asked for (``--speculative-tokens N``)
        until a multi-GPU run has checked the mirrored draft (as for its decode graphs)."""
        if self.speculative_tokens is None and self.world_size > 1:
            return 0
        return self.speculative_tokens

    @property
    def loads_mtp(self) -> bool:
        """Whether the MTP layers are worth loading: not when speculative decoding is off (their
        weights would only take KV memory)."""
        return self.mtp_tokens != 0

    @property
    def checkpoint_every(self) -> int:
        """The periodic checkpoint interval in tokens (0: none)."""
        if self.prefix_checkpoint_every is None:
            return PREFIX_CHECKPOINT_PAGES * self.page_size
        return self.prefix_checkpoint_every

    @property
    def queue(self) -> QueuePolicy:
        return QueuePolicy(self.queue_policy, self.queue_wait_credit)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            self.max_num_batched_tokens, self.max_num_seqs, self.max_chunk_tokens, self.swa_release_interval
        )


class ContextLimitError(ValueError):
    """``max_model_len`` past the model's own limit (vLLM refuses it too: positions past the ones
    the model was built for give it inputs it never saw)."""


def context_limit(configured: int | None, model_limit: int) -> int:
    """The context limit an engine runs with: ``max_model_len`` when set (at most the model's
    ``max_position_embeddings``, else a ``ContextLimitError``), the model's own otherwise."""
    if configured is not None and configured > model_limit:
        raise ContextLimitError(f"max_model_len {configured} is more than this model's limit of {model_limit} "
                                f"tokens (its max_position_embeddings)")
    return configured or model_limit


def pool_sizing(c: EngineConfig, layout: KVLayout, *, dtype: torch.dtype, device: torch.device | str,
                max_model_len: int, prefix_caching: bool,
                default_budget: Callable[[torch.device | str, float], int] = default_kv_budget_bytes) -> PoolSizing:
    """The pool sizes an engine with config ``c`` builds (see ``EngineConfig``; benchmarks/kv_capacity.py
    reports them for real models): explicit sizes win, SWA gets its need, Full the rest of the budget
    (``default_budget(device, memory_fraction)``: this process's, or the smallest of a rank group's)."""
    swa = c.num_swa_tokens
    if swa is None:
        swa = swa_tokens_needed(
            layout, page_size=c.page_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, swa_release_interval=c.swa_release_interval,
            checkpoint_reserve_windows=c.swa_checkpoint_reserve_windows if prefix_caching else 0)
    if c.num_full_tokens is not None:  # SWA pages past the Full pool's could never be mapped
        return PoolSizing(c.num_full_tokens, swa if c.num_swa_tokens is not None else min(swa, c.num_full_tokens))
    if c.kv_cache_bytes is not None:
        return PoolSizing.from_bytes(layout, c.kv_cache_bytes, dtype=dtype, page_size=c.page_size, swa_tokens=swa)
    # the default budget: never more Full KV than max_num_seqs requests of max_model_len can use
    return PoolSizing.from_bytes(layout, default_budget(device, c.memory_fraction), dtype=dtype,
                                 page_size=c.page_size, swa_tokens=swa, max_full_tokens=c.max_num_seqs * max_model_len)
