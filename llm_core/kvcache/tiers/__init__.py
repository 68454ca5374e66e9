"""The KV tiers behind the radix cache: L2 host memory and an L3 key -> bytes store (docs/kv_cache.md §8)."""
