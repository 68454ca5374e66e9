"""Generic key → bytes stores with checksummed entries, shared by the encoder cache (mm_pipeline)
and the KV-cache tiers (llm_core).  A store never raises for a damaged or unreachable backend:
that is a miss."""

from llm_core.storage.delayed_store import DelayedStore
from llm_core.storage.entry_codec import CorruptEntry, decode_entry, encode_entry
from llm_core.storage.kv_store import KeyValueStore
from llm_core.storage.local_dir_store import LocalDirStore
from llm_core.storage.memory_store import MemoryStore
from llm_core.storage.redis_store import RedisAddress, RedisStore

__all__ = [
    "CorruptEntry",
    "DelayedStore",
    "KeyValueStore",
    "LocalDirStore",
    "MemoryStore",
    "RedisAddress",
    "RedisStore",
    "decode_entry",
    "encode_entry",
]
