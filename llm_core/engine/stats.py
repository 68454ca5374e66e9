"""EngineStats: an immutable snapshot of the LLM engine, built on the engine thread; and the
scheduler's TokenCounters it reads.

The engine thread owns the KV pools, the scheduler's queues and the prefix cache; no other thread
may read them while it runs (the radix cache's node dict changes under an iterating reader). So
the engine thread builds one snapshot per step (``LLMEngine.publish_stats``) and publishes it by
swapping one reference; any thread reads the last one with ``LLMEngine.stats()``:

    engine thread:  step() ─► EngineStats.collect(pool, scheduler, prefix stats) ─► self._stats = s
    HTTP thread:    engine.stats() ─► s (frozen; its mappings are read-only views)

Field names are the names the server exposes to Prometheus (``mmserve_`` + name; a counter gets
``_total``). A mapping field is one metric family whose key is the label named in its comment.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from llm_core.engine.request import Request, RequestStatus

_TIERS = ("l1", "l2", "l3")  # the prefix cache's tiers: device pool, host memory, KV store
_POOLS = ("full", "swa")


def frozen_map(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy: a snapshot must not change after it is published."""
    return MappingProxyType(dict(d))


def as_plain(value: Any) -> Any:
    """JSON-ready copy of a snapshot value (dataclasses and mappings become dicts)."""
    if hasattr(value, "__dataclass_fields__"):
        out = {f.name: as_plain(getattr(value, f.name)) for f in fields(value)}
        out.update({k: getattr(value, k) for k in getattr(value, "_derived", ())})
        return out
    if isinstance(value, Mapping):
        return {k: as_plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class PoolUsage:
    """One KV pool, in pages (``EngineStats.kv_page_size`` tokens each)."""

    total_pages: int
    used_pages: int
    peak_pages: int  # most pages ever in use at once
    total_bytes: int  # the pool's K/V buffers over all its layers (the split the start-up prints)

    _derived = ("free_pages",)

    @property
    def free_pages(self) -> int:
        return self.total_pages - self.used_pages


@dataclass(frozen=True)
class EngineStats:
    """The LLM engine at one instant (see the module doc for who builds it and the names)."""

    kv_pool: Mapping[str, PoolUsage]  # label pool: "full", "swa"
    kv_page_size: int  # tokens per page, both pools
    max_context_tokens: int  # the longest prompt + output one request can hold (model limit, Full pool)
    running: int  # requests the scheduler is computing (prefill or decode)
    queue_depth: int  # requests waiting to be admitted (new, or preempted back)
    preemptions: int  # counter
    prefix_cache_hit_tokens: Mapping[str, int]  # counter, label tier: l1 (pool), l2 (host), l3 (store)
    prefix_cache_query_tokens: int  # counter: prompt tokens looked up in the prefix cache
    prefix_cache_evicted_pages: Mapping[str, int]  # counter, label pool
    # Everything else the prefix cache reports, under its own names (tree size, tier traffic). Empty
    # when prefix caching is off.
    prefix_cache: Mapping[str, int]
    taken_at: float  # time.monotonic() when built
    kv_l3_loading: int = 0  # waiting requests whose cached prefix is being read from L3 (not scheduled)
    # counter: prompt tokens computed by prefill, each request's once (prefix-cache hits at its first
    # admission: prefix_cache_hit_tokens; its recompute after a preemption: recomputed_tokens)
    prompt_tokens: int = 0
    # counter: tokens (prompt and generated) computed again after preemptions
    recomputed_tokens: int = 0
    generation_tokens: int = 0  # counter: tokens generated (handed to requests)
    # speculative decoding (MTP), all zero / empty when it is off
    spec_draft_tokens: int = 0  # counter: draft tokens proposed
    spec_accepted_tokens: int = 0  # counter: draft tokens the target accepted
    spec_verify_steps: int = 0  # counter: (request, step) pairs that verified drafts
    spec_accepted_length: Mapping[str, int] = field(default_factory=lambda: frozen_map({}))  # counter, label accepted: drafts accepted per verify

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_tokens(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the bonus token; 0 before any)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0

    _derived = ("spec_acceptance_rate", "spec_mean_accepted_tokens")

    @classmethod
    def collect(cls, pool, scheduler, prefix_stats: Mapping[str, int], now: float | None = None, *,
                max_model_len: int, speculative=None, generation_tokens: int = 0) -> "EngineStats":
        """Read ``pool`` (a DualKVPool) and ``scheduler``; engine thread only. ``prefix_stats`` is
        the prefix cache's ``stats()`` dict (read by the caller, which decides how often);
        ``speculative`` the SpecStats of a speculative engine; ``generation_tokens`` the engine's
        count of tokens it handed out."""
        rest = dict(prefix_stats)
        rest.pop("hit_tokens", None)  # the sum over the tiers
        hits = {t: rest.pop(f"hit_tokens_{t}") for t in _TIERS if f"hit_tokens_{t}" in rest}
        evicted = {p: rest.pop(f"evicted_{p}_pages", 0) for p in _POOLS} if prefix_stats else {}
        return cls(
            kv_pool=frozen_map({name: PoolUsage(a.num_pages, a.num_used, a.peak_used, nbytes)
                                for name, a, nbytes in (("full", pool.full, pool.full_bytes),
                                                        ("swa", pool.swa, pool.swa_bytes))}),
            kv_page_size=pool.page_size,
            max_context_tokens=min(max_model_len, pool.full.num_pages * pool.page_size),
            running=len(scheduler.running),
            queue_depth=len(scheduler.waiting),
            preemptions=scheduler.num_preemptions,
            prefix_cache_hit_tokens=frozen_map(hits),
            prefix_cache_query_tokens=rest.pop("query_tokens", 0),
            prefix_cache_evicted_pages=frozen_map(evicted),
            prefix_cache=frozen_map(rest),
            taken_at=time.monotonic() if now is None else now,
            kv_l3_loading=sum(1 for r in scheduler.waiting if r.status is RequestStatus.LOADING),
            prompt_tokens=scheduler.num_prompt_tokens,
            recomputed_tokens=scheduler.num_recomputed_tokens,
            generation_tokens=generation_tokens,
            **({} if speculative is None else dict(
                spec_draft_tokens=speculative.draft_tokens, spec_accepted_tokens=speculative.accepted_tokens,
                spec_verify_steps=speculative.verify_steps,
                spec_accepted_length=frozen_map({str(a): n for a, n in enumerate(speculative.accepted_length)}))),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (for JSON: ``/health``, benchmark reports)."""
        return as_plain(self)


class TokenCounters:
    """The scheduler's token counters (``Scheduler.counters``; engine thread only).

    Each request's tokens count once, as vLLM counts them (its recompute after a preemption is not
    a new prompt): ``num_prompt_tokens``, each request's prompt less its first admission's prefix
    hit (Request.num_computed_high), counted as prefill passes it -- what its usage reports as prompt
    minus cached tokens, with the hit counter adding up to the prompt: a re-admission's hit past the
    mark (another request cached the rest of the prompt meanwhile) counts, as the first admission's
    hit did not cover it; and ``num_recomputed_tokens``, the tokens recomputed after
    preemptions (prompt and generated, below that mark), the preemptions' cost."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_recomputed_tokens = 0
        # Prompt tokens the prefix cache supplied at each request's first admission: what its outputs
        # report (cached_prompt_tokens). Request.num_cached_tokens is the last admission's hit, which
        # the prefix cache counts in its stats; after a preemption that hit covers the request's own
        # generated tokens too and would report more cached tokens than the prompt has.
        self._first_hits: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def cached_prompt_tokens(self, request: Request) -> int:
        """Prompt tokens the prefix cache supplied when ``request`` was first admitted (vLLM's
        ``num_cached_tokens``; 0 before that): at most the prompt, and kept over preemptions."""
        return self._first_hits.get(request, 0)

    def admitted(self, req: Request) -> None:
        """``req`` was just admitted, its prefix hit (``num_computed_tokens``) matched."""
        self._first_hits.setdefault(req, min(req.num_cached_tokens, req.num_prompt_tokens))
        if req.num_preemptions == 0:
            req.num_computed_high = req.num_computed_tokens  # the hit: not prompt work to count
        self._count_progress(req, req.num_computed_tokens)  # a re-admission's hit past the mark

    def computed(self, req: Request, start: int, end: int) -> None:
        """A step computed ``req``'s tokens ``[start, end)``."""
        self.num_recomputed_tokens += max(0, min(end, req.num_computed_high) - start)
        self._count_progress(req, end)

    def _count_progress(self, req: Request, end: int) -> None:
        """``req`` has its tokens up to ``end``: count the prompt tokens past its mark, move the mark.

            prompt P = 10 tokens, 4 of them a prefix hit at its first admission:
            first admission   mark 4; steps compute 4..13 (3 generated): prompt tokens 6 (= P - hit),
                              mark 13; then it is preempted
            re-admission      a hit of 8 (its own pages, cached when it was preempted); steps
                              compute 8..13 again: recomputed tokens 5, no prompt token (below 13)"""
        high = req.num_computed_high
        if end > high:
            p = req.num_prompt_tokens
            self.num_prompt_tokens += max(0, min(end, p) - min(high, p))
            req.num_computed_high = end
