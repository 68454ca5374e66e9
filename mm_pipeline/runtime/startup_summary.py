"""What ``mmserve serve`` prints once the model is up: model, device, the KV pool split, the context
one request can hold, prefix caching, the threads, speculative decoding and the sampling defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def describe_engine(engine: Any, model_dir: Path) -> list[str]:
    """What a user of ``serve`` needs once the model is up: model, device, the KV pool split (tokens,
    bytes, the longest context one request can hold), prefix caching, the threads' intra-op counts.
    Read before any request runs (sizes and counts only; they never change)."""
    from llm_core.kvcache.prefix_cache import NoPrefixCache

    llm = engine.runtime.llm
    pool, page = llm.pool, llm.pool.page_size
    cfg = llm.config
    caching = "off"
    if not isinstance(llm.prefix_cache, NoPrefixCache):
        every = f" and every {cfg.checkpoint_every} tokens" if cfg.checkpoint_every else ""
        caching = f"on (SWA windows kept at media and message ends{every})"
    full_tokens = pool.full.num_pages * page
    parallel = []
    if cfg.world_size > 1:
        parallel = [f"parallel  {cfg.world_size} ranks: tensor-parallel {cfg.tensor_parallel_size}, expert-parallel "
                    f"{cfg.expert_parallel_size}; KV pools below are per rank"]
    return [f"model     {engine.model_name} ({model_dir})", *parallel,
            f"device    {llm.device}, {str(llm.dtype).removeprefix('torch.')}",
            f"KV pools  Full {full_tokens:,} tokens ({_mib(pool.full_bytes)}), "
            f"SWA {pool.swa.num_pages * page:,} tokens ({_mib(pool.swa_bytes)}) for {cfg.max_num_seqs} "
            f"requests; pages of {page} tokens",
            f"context   {min(llm.max_model_len, full_tokens):,} tokens max per request "
            f"(model limit {llm.max_model_len:,}); prefix caching {caching}",
            *([f"threads   {threads} (intra-op; --llm-threads, --encoder-threads)"]
              if (threads := engine.runtime.describe_threads()) else []),
            _decoding(llm),
            *([f"sampling  defaults: {engine.generation_defaults.describe()} "
               f"(--generation-config vllm: built-in ones)"] if engine.generation_defaults.given else [])]


def _decoding(llm: Any) -> str:
    """Whether MTP speculative decoding is on (the default where the checkpoint has MTP layers): it
    changes speed, never tokens, and plain-text serving may be faster without it."""
    spec = llm.speculative
    if spec is None:
        return "decoding  one token per step (speculative decoding off or no MTP layers: --speculative-tokens)"
    how = "adaptive, per request" if spec.draft_length.adaptive else "fixed"
    return (f"decoding  MTP speculative, up to {spec.proposer.max_draft} draft tokens ({how}; layers "
            f"{spec.proposer.mode}); --speculative-tokens 0: off")
