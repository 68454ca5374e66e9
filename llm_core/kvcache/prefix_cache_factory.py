"""The engine's prefix cache built from its ``EngineConfig``: an ``SWARadixCache``, with ``KVTiers``
(L2 host memory and/or an L3 store) when the config asks for them, keyed by a model id."""

from __future__ import annotations

import blake3
import torch

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.tiers.host_kv_pool import HostKVPool
from llm_core.kvcache.tiers.kv_tiers import KVTiers
from llm_core.kvcache.swa_radix_cache import SWARadixCache
from llm_core.storage import KeyValueStore, LocalDirStore, RedisStore

KV_STORE_PREFIX = "mmserve-kv:"  # Redis key namespace of KV pages (the encoder cache uses "mmserve:")


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A model id from its config and every byte of every parameter and buffer (with its name, shape
    and dtype): two checkpoints that differ in any one element never share L3 entries. A sample is
    not enough -- a fine-tune of k_proj sits in the middle of the fused qkv_proj. Computed once per
    engine (``build_prefix_cache``); ``kv_model_id`` skips it."""
    h = blake3.blake3(repr(getattr(model, "config", None)).encode(), max_threads=blake3.blake3.AUTO)
    for kind, tensors in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in tensors:  # module registration order: the same for every load of one config
            h.update(f"{kind}|{name}|{tuple(t.shape)}|{t.dtype}".encode())
            h.update(_tensor_bytes(t))
    return h.hexdigest()[:32]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` in row-major order, read in place when it is a contiguous CPU tensor;
    otherwise from a host copy of this one tensor only, so the whole model is never copied at once."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # uint8 view: numpy has no bfloat16 / float8, and the hash wants the stored bytes, not values
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def open_kv_store(location: str, max_bytes: int | None = None) -> KeyValueStore:
    """The L3 store ``kv_store`` names: a ``redis://`` URL or a directory (capped at ``max_bytes``,
    LRU; Redis bounds itself with its maxmemory policy). Anything with a ``scheme://`` is taken for
    a URL, so a mistyped scheme raises instead of becoming a directory."""
    if "://" in location:
        return RedisStore.from_url(location, prefix=KV_STORE_PREFIX)
    return LocalDirStore(location, max_bytes=max_bytes)


def build_prefix_cache(pool: DualKVPool, config, model: torch.nn.Module) -> SWARadixCache:
    """The engine's prefix cache from its EngineConfig: an SWARadixCache, with tiers when configured."""
    tiers = None
    if config.kv_host_bytes or config.kv_store:
        host = None
        if config.kv_host_bytes:
            host = HostKVPool(pool.layout, pool.page_size, pool.dtype, config.kv_host_bytes,
                              pin_for=pool.device if pool.device.type == "cuda" else None)
        store = open_kv_store(config.kv_store, config.kv_store_bytes) if config.kv_store else None
        model_id = config.kv_model_id or weights_fingerprint(model)
        tiers = KVTiers(pool, host=host, store=store, model_id=model_id,
                        l3_load_timeout_s=config.kv_l3_load_timeout_s)
    return SWARadixCache(pool, checkpoint_every=config.checkpoint_every, tiers=tiers)
