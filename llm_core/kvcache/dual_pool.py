"""The dual KV pool: a paged Full pool (every token) and a paged SWA pool (only the window).

Both pools share one page size and one *logical* page index per request (the Full index is
authoritative); a request keeps two page tables of equal length:

    logical page:      0    1    2    3    4    5        (page_size tokens each)
    full_pages:       [17,   3,  42,   8,  11,  29]      every page mapped
    swa_pages:        [-1,  -1,  -1,   5,   0,   7]      Full->SWA map; -1 = released (behind window)

Physical layout of each per-layer buffer (kernels/attention_ref.py):

    k_cache[slot] with slot = page * page_size + offset,   k_cache: [num_slots, kv_heads, head_dim]

A layer of kind "full" reads/writes the Full pool, a layer of kind "sliding" the SWA pool, so the
SWA pool's size is independent of context length. Byte accounting is exact (element size x shape)
and works on the ``meta`` device, which is how capacity is planned without allocating.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch

from kernels.cpu import huge_pages as huge_page_memory
from llm_core.model.config import layers_of_kind


class KVPoolSizeError(ValueError):
    """Pool sizes this model's layout cannot have -- a byte budget (kv_cache_bytes, memory_fraction's
    share) too small for one Full page beside the SWA pool, no SWA page for a model with sliding
    layers: known only once the layout is (a setting, not a bug)."""


class PoolExhausted(RuntimeError):
    """Raised by :meth:`PageAllocator.allocate` when fewer pages are free than asked for."""


@dataclass(frozen=True)
class KVHeadSpec:
    """Per-token KV geometry of one attention kind."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def elements_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class KVLayout:
    """The hybrid layout as data: one kind per layer plus the KV geometry of each kind.

    ``window`` counts visible keys including the query (transformers semantics); None when the model
    has no sliding layers.
    """

    layer_kinds: tuple[str, ...]
    full: KVHeadSpec
    sliding: KVHeadSpec
    window: int | None

    def __post_init__(self) -> None:
        bad = [k for k in self.layer_kinds if k not in ("full", "sliding")]
        if bad:
            raise ValueError(f"layer kinds must be 'full' or 'sliding', got {bad[0]!r}")
        if self.swa_layers and (self.window is None or self.window < 1):
            raise ValueError(f"a layout with sliding layers needs a window >= 1, got {self.window}")

    @classmethod
    def from_model_config(cls, config) -> "KVLayout":
        """Read the layout from a :class:`llm_core.model.config.ModelConfig` (duck-typed)."""
        return cls.from_specs(config, config.full_attn, config.swa_attn)

    @classmethod
    def from_specs(cls, config, full_attn, swa_attn) -> "KVLayout":
        """The layout of ``config``'s layers with the given per-kind head specs (one tensor-parallel
        rank's share: its own KV heads; ``MiMoV2ForCausalLM.kv_layout``)."""

        def spec(a) -> KVHeadSpec:
            return KVHeadSpec(a.num_kv_heads, a.head_dim, a.v_head_dim)

        kinds = tuple(config.layer_kinds)
        window = config.sliding_window if "sliding" in kinds else None
        return cls(kinds, spec(full_attn), spec(swa_attn), window)

    # derived once (the scheduler asks ``has_swa`` several times per request and step)
    @functools.cached_property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full layers."""
        return layers_of_kind(self.layer_kinds, "full")

    @functools.cached_property
    def swa_layers(self) -> tuple[int, ...]:
        """Indices of the sliding layers."""
        return layers_of_kind(self.layer_kinds, "sliding")

    def full_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K+V bytes one token costs in the Full pool, over all full layers."""
        return len(self.full_layers) * self.full.elements_per_token() * _itemsize(dtype)

    def swa_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K+V bytes one token costs in the SWA pool, over all sliding layers."""
        return len(self.swa_layers) * self.sliding.elements_per_token() * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class PageAllocator:
    """Free list of physical pages with reference counts.

    Invariant (checked by :meth:`check_integrity`): a page is on the free list exactly when its
    reference count is 0. Reference counts above 1 are for a prefix cache sharing pages between a
    tree node and requests; the engine alone only ever holds one reference.
    """

    def __init__(self, num_pages: int, name: str) -> None:
        if num_pages < 0:
            raise ValueError(f"{name} pool: num_pages must be >= 0, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first (easier to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: list[int] = [0] * num_pages
        self.peak_used = 0

    # ---- public API -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (reference count 1 each)."""
        if n < 0:
            raise ValueError(f"{self.name} pool: cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolExhausted(f"{self.name} pool: {n} pages wanted, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def incref(self, pages: list[int]) -> None:
        """Add one reference to each (already allocated) page, e.g. when a request shares it."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"{self.name} pool: incref of free page {p}")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching 0 return to the free list.

        Negative entries (released markers in a page table) are skipped.
        """
        for p in pages:
            if p < 0:
                continue
            if self._refs[p] <= 0:
                raise RuntimeError(f"{self.name} pool: double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check_integrity(self) -> None:
        """Raise if the free list and the reference counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name} pool: a page is on the free list twice")
        for p, r in enumerate(self._refs):
            if r < 0 or (r == 0) != (p in free):
                raise AssertionError(f"{self.name} pool: page {p} refcount {r}, on free list: {p in free}")

    def check_refs(self, refs: Counter[int]) -> None:
        """Raise AssertionError unless every page's reference count is ``refs[page]``, what its owners
        (a prefix cache's tree and the requests) account for (``SWARadixCache.check_integrity``)."""
        for page in range(self.num_pages):
            assert self.refcount(page) == refs[page], \
                f"{self.name} page {page}: refcount {self.refcount(page)}, owners account for {refs[page]}"


class DualKVPool:
    """Per-layer K/V buffers of both pools plus their page allocators (the model's ``KVBuffers``).

    ``layer(i)`` returns the (k_cache, v_cache) of the pool layer ``i``'s kind reads. With
    ``device="meta"`` nothing is allocated but every byte count is the real one.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_full_tokens: int,
        num_swa_tokens: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        huge_pages: bool = False,
    ) -> None:
        """``huge_pages``: on CPU, the K/V buffers live on huge-page-advised memory
        (kernels/cpu/huge_pages.py: a decode step streams them from memory; fewer TLB misses)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_full_tokens < page_size:
            raise ValueError(f"Full pool needs at least one page ({page_size} tokens), got {num_full_tokens}")
        if layout.swa_layers and num_swa_tokens < page_size:
            raise KVPoolSizeError(f"SWA pool needs at least one page ({page_size} tokens), got {num_swa_tokens}")
        self.layout = layout
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        num_swa_pages = num_swa_tokens // page_size if layout.swa_layers else 0
        self.full = PageAllocator(num_full_tokens // page_size, "Full")
        self.swa = PageAllocator(num_swa_pages, "SWA")
        shapes = []
        for kind in layout.layer_kinds:
            spec = layout.full if kind == "full" else layout.sliding
            slots = (self.full.num_pages if kind == "full" else self.swa.num_pages) * page_size
            shapes += [(slots, spec.num_kv_heads, spec.head_dim), (slots, spec.num_kv_heads, spec.v_head_dim)]
        if huge_pages and self.device.type == "cpu" and huge_page_memory.supported():
            kv = huge_page_memory.zeros(shapes, dtype)
        else:
            kv = [torch.zeros(shape, dtype=dtype, device=self.device) for shape in shapes]
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(kv[0::2], kv[1::2]))

    # ---- public API -------------------------------------------------------------------------
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer ``i`` (Full pool for "full" layers, SWA pool for "sliding")."""
        return self._buffers[i]

    @property
    def has_swa(self) -> bool:
        return bool(self.layout.swa_layers)

    @property
    def full_bytes_per_token(self) -> int:
        return self.layout.full_bytes_per_token(self.dtype)

    @property
    def swa_bytes_per_token(self) -> int:
        return self.layout.swa_bytes_per_token(self.dtype)

    @functools.cached_property
    def full_bytes(self) -> int:
        """Bytes held by the Full pool buffers (all full layers, K and V; fixed at construction:
        computed once, the engine's stats read it every step)."""
        return self._pool_bytes("full")

    @functools.cached_property
    def swa_bytes(self) -> int:
        return self._pool_bytes("sliding")

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.swa_bytes

    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.swa.check_integrity()

    def all_free(self) -> bool:
        return self.full.num_used == 0 and self.swa.num_used == 0

    # ---- internal helpers -------------------------------------------------------------------
    def _pool_bytes(self, kind: str) -> int:
        total = 0
        for layer_kind, (k, v) in zip(self.layout.layer_kinds, self._buffers):
            if layer_kind == kind:
                total += k.numel() * k.element_size() + v.numel() * v.element_size()
        return total


# On CPU the KV pools take a fixed space by default, as vLLM-CPU's VLLM_CPU_KVCACHE_SPACE does: a share
# of all free RAM made a 9 MB demo model start at ~10 GB RSS (docs/kv_cache.md §1, "Sizing").
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


def swa_tokens_needed(layout: KVLayout, *, page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                      swa_release_interval: int, checkpoint_reserve_windows: int = 0) -> int:
    """SWA pool tokens for ``max_num_seqs`` running requests plus a checkpoint reserve (0 without
    sliding layers):

        per running request   window + swa_release_interval (decode slack) + 2 pages of rounding
        per step              max_num_batched_tokens (all chunks of one step together; the
                              scheduler releases a chunk's out-of-window pages right after it)
        reserve               checkpoint_reserve_windows x (window rounded up to pages + 1 page),
                              for windows the prefix cache keeps (checkpoints, finished prompts)
    """
    if not layout.swa_layers:
        return 0
    assert layout.window is not None
    per_req = layout.window + swa_release_interval + 2 * page_size
    reserve = checkpoint_reserve_windows * (_round_up(layout.window, page_size) + page_size)
    return _round_up(max_num_seqs * per_req + max_num_batched_tokens + reserve, page_size)


@dataclass(frozen=True)
class PoolSizing:
    """How many tokens each pool holds."""

    num_full_tokens: int
    num_swa_tokens: int

    @classmethod
    def from_bytes(cls, layout: KVLayout, budget_bytes: int, *, dtype: torch.dtype, page_size: int,
                   swa_tokens: int, max_full_tokens: int | None = None) -> "PoolSizing":
        """Split a byte budget: the SWA pool gets ``swa_tokens`` (``swa_tokens_needed``), the Full pool
        the rest, at most ``max_full_tokens`` (what the model can use; None: no cap)."""
        swa_per_tok = layout.swa_bytes_per_token(dtype)
        full_per_tok = layout.full_bytes_per_token(dtype)
        swa_tokens = _round_up(swa_tokens, page_size) if layout.swa_layers else 0
        rest = budget_bytes - swa_tokens * swa_per_tok
        if full_per_tok == 0:
            full_tokens = page_size
        else:
            full_tokens = rest // full_per_tok
            if max_full_tokens is not None:
                full_tokens = min(full_tokens, _round_up(max_full_tokens, page_size))
            full_tokens = full_tokens // page_size * page_size
        if full_tokens < page_size:
            raise KVPoolSizeError(
                f"KV budget of {budget_bytes} bytes is too small: the SWA pool alone needs "
                f"{swa_tokens * swa_per_tok} bytes and the Full pool one page of {page_size} tokens"
            )
        return cls(full_tokens, swa_tokens)


def default_kv_budget_bytes(device: torch.device | str, memory_fraction: float) -> int:
    """The KV budget when none is configured: ``memory_fraction`` of the free memory of a CUDA
    device (vLLM's gpu_memory_utilization idea), a fixed ``DEFAULT_CPU_KV_CACHE_BYTES`` on CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return DEFAULT_CPU_KV_CACHE_BYTES
    return int(available_memory_bytes(device) * memory_fraction)


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory on a CUDA ``device`` now (the driver's count)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cannot size a KV pool from a memory fraction on device {device}; "
                         f"give kv_cache_bytes or num_full_tokens")
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
