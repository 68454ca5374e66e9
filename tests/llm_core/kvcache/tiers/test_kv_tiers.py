"""KV tiers: host pool rows, L1 <-> row copies, the L3 value format and keys, layer-wise loading, and the
fingerprinting harness (test_swa_radix_cache) with hits served from L2 and L3, across a restart, with
damaged L3 entries and with Redis down; where the L3 store is and its default cap. What goes to L3 (puts
and keep-alive touches) is test_l3_writes.py's; ``tiers``, ``harness`` and ``replay`` here serve both."""

from __future__ import annotations

import threading
from types import SimpleNamespace
import time

import pytest
import torch

from llm_core.kvcache.dual_pool import DualKVPool, KVHeadSpec, KVLayout
from llm_core.kvcache.tiers.host_kv_pool import HostKVPool, row_elements
from llm_core.kvcache.prefix_cache_factory import open_kv_store
from llm_core.kvcache.tiers.kv_tiers import KVTiers
from llm_core.kvcache.tiers.page_format import (chain_seed, decode_page, encode_page, gather_pages, layer_columns,
                                                page_hash, scatter_layer)
from llm_core.kvcache.tiers.tier_threads import LayerwiseKV, LoadJob, add_layer_copies
from llm_core.storage import LocalDirStore, MemoryStore, RedisStore
from tests.llm_core.kvcache.test_swa_radix_cache import BASES, Harness

LAYOUT = KVLayout(("full", "sliding", "sliding"), KVHeadSpec(2, 3, 2), KVHeadSpec(1, 4, 3), window=4)


def row_bytes(layout=LAYOUT, page=2) -> int:
    return (row_elements(layout, "full", page) + row_elements(layout, "sliding", page)) * 4


def test_host_pool_lru_and_swa_only_shortage():
    full_row = row_elements(LAYOUT, "full", 2) * 4
    host = HostKVPool(LAYOUT, 2, torch.float32, 3 * full_row * 2, swa_fraction=0.5)
    assert host.num_full_rows == 3 and host.num_swa_rows >= 1
    rows = {k: torch.full((host.full_elems,), float(k)) for k in range(5)}
    for k in range(4):
        host.put(bytes([k]), rows[k], torch.full((host.swa_elems,), -float(k)))
    assert host.get(bytes([0])) is None  # LRU entry went for the fourth
    for k in (1, 2, 3):
        e = host.get(bytes([k]))
        assert torch.equal(host.full_data[e.full_row], rows[k])
    with_swa = [k for k in (1, 2, 3) if host.get(bytes([k])).swa_row >= 0]
    assert len(with_swa) == host.num_swa_rows  # SWA rows ran short first: entries kept their Full rows
    host.check_integrity()
    with pytest.raises(ValueError, match="holds no page"):
        HostKVPool(LAYOUT, 2, torch.float32, 8)


def test_each_layer_copy_carries_only_its_own_columns():
    """A load's per-layer copies: each layer gets its columns of the stacked rows (K then V of that
    layer), so what crosses to the device per layer is 1/L of a row, and together they tile the row."""
    rows = [torch.arange(row_elements(LAYOUT, "sliding", 2), dtype=torch.float32) + 1000 * i for i in range(3)]
    copies: dict = {}
    add_layer_copies(copies, SimpleNamespace(layout=LAYOUT, page_size=2), "sliding", [7, 8, 9], rows)
    swa_layers = [i for i, k in enumerate(LAYOUT.layer_kinds) if k == "sliding"]
    assert sorted(copies) == swa_layers
    per_layer = 2 * LAYOUT.sliding.elements_per_token()
    parts = [copies[layer][0][1] for layer in swa_layers]
    assert all(p.shape == (3, per_layer) for p in parts) and all(copies[i][0][0] == [7, 8, 9] for i in swa_layers)
    assert torch.equal(torch.cat(parts, dim=1), torch.stack(rows))


def test_gather_and_scatter_move_only_valid_pages():
    pool = DualKVPool(LAYOUT, num_full_tokens=16, num_swa_tokens=16, page_size=2)
    for i in range(3):
        for t in pool.layer(i):
            t.copy_(torch.randn_like(t))
    full = gather_pages(pool, "full", [1, 3])
    swa = gather_pages(pool, "sliding", [2, -1])
    assert torch.count_nonzero(swa[1]) == 0  # the invalid page was not read
    other = DualKVPool(LAYOUT, num_full_tokens=16, num_swa_tokens=16, page_size=2)
    for layer in range(3):
        kind = LAYOUT.layer_kinds[layer]
        rows = full if kind == "full" else swa
        scatter_layer(other, layer, [5, 6] if kind == "full" else [4, -1], rows[:, layer_columns(LAYOUT, 2, layer)])
    with pytest.raises(ValueError, match="layer 1's part"):
        scatter_layer(other, 1, [4, -1], swa)  # whole rows: a layer takes its own columns only
    for layer in range(3):
        for src, dst in zip(pool.layer(layer), other.layer(layer)):
            if LAYOUT.layer_kinds[layer] == "full":
                assert torch.equal(dst[10:14], torch.cat([src[2:4], src[6:8]]))
            else:
                assert torch.equal(dst[8:10], src[4:6]) and torch.count_nonzero(dst[:8]) == 0


def test_page_value_format_rejects_foreign_and_damaged_values():
    full, swa = torch.randn(10), torch.randn(6)
    raw = encode_page(full, swa)
    got = decode_page(raw, torch.float32, 10, 6)
    assert torch.equal(got[0], full) and torch.equal(got[1], swa)
    assert decode_page(encode_page(full, None), torch.float32, 10, 6)[1] is None
    assert decode_page(raw, torch.float32, 11, 6) is None  # another geometry
    assert decode_page(raw, torch.bfloat16, 10, 6) is None  # another dtype
    assert decode_page(raw[:-3], torch.float32, 10, 6) is None  # truncated
    assert decode_page(b"junk", torch.float32, 10, 6) is None


def test_hash_chain_covers_prefix_media_and_model():
    seed = chain_seed("m", LAYOUT, 2, torch.float32)
    assert seed != chain_seed("other", LAYOUT, 2, torch.float32)
    assert seed != chain_seed("m", LAYOUT, 4, torch.float32)
    a = page_hash(page_hash(seed, (1, 2)), (3, 4))
    assert a == page_hash(page_hash(seed, (1, 2)), (3, 4))
    assert a != page_hash(page_hash(seed, (1, 5)), (3, 4))  # an earlier page changes every later hash
    assert page_hash(seed, ((1, b"x"), 2)) != page_hash(seed, ((1, b"y"), 2)) != page_hash(seed, (1, 2))


def test_layerwise_view_releases_each_layer_when_it_lands():
    pool = DualKVPool(LAYOUT, num_full_tokens=8, num_swa_tokens=8, page_size=2)
    job = LoadJob({}, [threading.Event() for _ in range(3)])
    landed: list[float] = []

    def loader():
        for e in job.events:
            time.sleep(0.02)
            landed.append(time.monotonic())
            e.set()

    t = threading.Thread(target=loader)
    t.start()
    view = LayerwiseKV(pool, [job])
    got = []
    for i in range(3):
        view.layer(i)
        got.append(time.monotonic())
    t.join()
    assert all(g >= s for g, s in zip(got, landed)) and got[0] < landed[2]  # layer 0 ran before layer 2 landed


def tiers(host_pages: int | None, store) -> callable:
    def make(pool):
        host = HostKVPool(pool.layout, pool.page_size, pool.dtype, host_pages * row_bytes(pool.layout, pool.page_size)
                          * 2) if host_pages else None
        return KVTiers(pool, host=host, store=store, model_id="tiers-test")

    return make


def harness(factory, **kw) -> Harness:
    cfg = dict(window=4, page=2, full_pages=20, swa_pages=12, budget=8, checkpoint=4)
    return Harness(tiers=factory, **{**cfg, **kw})


def replay(h: Harness, prompts: list[list[int]]) -> list:
    out = []
    for p in prompts:
        r = h.add(p, 3)
        h.drain()
        out.append(r)
    return out


PROMPTS = [BASES[i % 3][:n] for i, n in enumerate([30, 28, 26, 34, 30, 40, 30, 28, 26])]


@pytest.mark.parametrize("kind", ["l2", "l3", "l2+l3"])
def test_small_l1_hits_come_back_from_the_tiers(kind):
    h = harness(tiers(24 if "l2" in kind else None, MemoryStore(1 << 24) if "l3" in kind else None))
    reqs = replay(h, PROMPTS)  # every visible key of every step is checked by the harness
    stats = h.cache.stats()
    tier_hits = stats.get("hit_tokens_l2", 0) + stats.get("hit_tokens_l3", 0)
    assert tier_hits > 0 and stats["evicted_full_pages"] > 0
    assert sum(r.num_cached_tokens for r in reqs[3:]) > 0
    h.cache.tiers.close()
    if h.cache.tiers.host is not None:
        h.cache.tiers.host.check_integrity()


def test_restart_with_the_same_directory_hits_l3_and_damage_is_a_miss(tmp_path):
    first = harness(tiers(None, LocalDirStore(tmp_path)))
    replay(first, PROMPTS[:3])
    first.cache.close()  # writes the tree down
    second = harness(tiers(8, LocalDirStore(tmp_path)))
    again = replay(second, PROMPTS[:3])
    assert all(r.num_cached_tokens > 0 for r in again)
    assert second.cache.stats()["hit_tokens_l3"] > 0
    second.cache.close()
    files = sorted(tmp_path.glob("??/*.entry"))
    assert files
    for i, f in enumerate(files):  # truncate some entries, flip bytes in the others
        data = bytearray(f.read_bytes())
        if i % 2:
            f.write_bytes(bytes(data[: len(data) // 2]))
        else:
            data[-5] ^= 0xFF
            f.write_bytes(bytes(data))
    third = harness(tiers(None, LocalDirStore(tmp_path)))
    damaged = replay(third, PROMPTS[:3])  # the harness would catch any wrong KV
    assert third.cache.stats().get("hit_tokens_l3", 0) == 0
    assert [r.output_token_ids for r in damaged] == [r.output_token_ids for r in again]
    third.cache.close()



@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_damaged_l3_entries_are_replaced_by_the_next_save_and_the_repeat_hits(kind, tmp_path, request):
    """Every L3 entry damaged: the run that finds them recomputes and saves its pages, and the next
    repeat hits as after a healthy restart. A page saved without its SWA row used to keep whatever
    was there (existence only), and a chain read stops at its first missing page, so the damaged
    pages further down were never read, removed nor replaced: their hits stayed lost. No checkpoints,
    so the pages behind each prompt's last window lose their SWA and are saved without it."""
    prompts = [BASES[i][:n] for i, n in enumerate([40, 38, 36])]
    run = lambda: harness(tiers(None, open_store()), checkpoint=0)  # noqa: E731
    if kind == "dir":
        open_store = lambda: LocalDirStore(tmp_path)  # noqa: E731
    else:
        import redis

        port, prefix = request.getfixturevalue("redis_server"), f"dmg-{tmp_path.name}:"
        open_store = lambda: RedisStore(port=port, prefix=prefix)  # noqa: E731
    first = run()
    replay(first, prompts)
    first.cache.close()  # writes the tree down
    healthy = run()
    want = [r.num_cached_tokens for r in replay(healthy, prompts)]
    healthy.cache.close()
    assert sum(want) > 0
    if kind == "dir":
        files = sorted(tmp_path.glob("??/*.entry"))
        for f in files:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 1
            f.write_bytes(bytes(data))
    else:
        client = redis.Redis(port=port)
        files = client.keys(prefix + "*")
        for key in files:
            client.set(key, b"garbage")
    assert len(files) > 10
    damaged = run()
    assert [r.num_cached_tokens for r in replay(damaged, prompts)] == [0, 0, 0]
    damaged.cache.close()  # saves every page again: the damaged entries are replaced
    again = run()
    assert [r.num_cached_tokens for r in replay(again, prompts)] == want
    again.cache.close()
    if kind == "redis":
        client.close()

def test_redis_down_is_a_miss_and_redis_up_shares(redis_server):
    down = harness(tiers(None, RedisStore(port=1, timeout_s=0.05, retry_after_s=60)))
    replay(down, PROMPTS[:4])
    assert down.cache.stats().get("hit_tokens_l3", 0) == 0
    down.cache.close()
    a = harness(tiers(None, RedisStore(port=redis_server, prefix="kvtest:")))
    replay(a, PROMPTS[:3])
    a.cache.close()
    b = harness(tiers(None, RedisStore(port=redis_server, prefix="kvtest:")))
    replay(b, PROMPTS[:3])
    assert b.cache.stats()["hit_tokens_l3"] > 0
    b.cache.close()


def test_a_failed_load_fails_the_step_and_the_cache_stops_handing_out_pages():
    h = harness(tiers(24, None))
    replay(h, PROMPTS[:6])
    t = h.cache.tiers
    job = t.threads.submit({0: [([0], torch.zeros(3, 3))]})  # rows of the wrong shape
    job.events[-1].wait(5)
    with pytest.raises(RuntimeError, match="loading cached KV failed"):
        h.cache.kv_buffers(h.pool)
    assert t.broken is not None
    r = replay(h, PROMPTS[:1])[0]
    assert r.num_cached_tokens == 0
    saved = t.counters["pages_saved"]
    h.cache.clear()  # evicts every node: nothing from a possibly damaged L1 reaches the tiers
    assert t.counters["pages_saved"] == saved
    t.close()


def test_kv_store_location_is_a_directory_or_a_redis_url(tmp_path):
    assert isinstance(open_kv_store(str(tmp_path / "l3")), LocalDirStore)
    redis = open_kv_store("redis://127.0.0.1:1/3")
    assert isinstance(redis, RedisStore) and redis.prefix == "mmserve-kv:"
    redis.close()
    with pytest.raises(ValueError, match="must start with redis://"):
        open_kv_store("s3://bucket/kv")  # a mistyped scheme is not a directory name
    with pytest.raises(ValueError, match="bad port"):
        open_kv_store("redis://127.0.0.1:xyz/0")


def test_the_l3_directory_store_is_capped_by_default(tmp_path):
    from llm_core.engine.engine_config import EngineConfig
    from llm_core.kvcache.prefix_cache_factory import build_prefix_cache

    pool = DualKVPool(LAYOUT, num_full_tokens=16, num_swa_tokens=16, page_size=2)
    cache = build_prefix_cache(pool, EngineConfig(kv_store=str(tmp_path), kv_model_id="m"), torch.nn.Linear(1, 1))
    assert cache.tiers.store.max_bytes == 8 << 30
    cache.close()
    small = build_prefix_cache(pool, EngineConfig(kv_store=str(tmp_path), kv_model_id="m", kv_store_bytes=4096),
                               torch.nn.Linear(1, 1))
    assert small.tiers.store.max_bytes == 4096
    small.close()
