"""The radix tree of dispatched prefixes (mm_pipeline/cluster/serving/router_state.py), in memory and in
Redis, against a naive oracle: each replica's matched depth is the longest common prefix between the
request and any chain that replica was sent; forgetting a replica removes exactly its entries."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mm_pipeline.cluster.serving.route_key import key_of_pieces
from mm_pipeline.cluster.serving.router_state import InflightWork, MemoryPrefixIndex, RedisPrefixIndex

REPLICAS = ["a", "b", "c"]
# block contents from a small alphabet so that prompts share prefixes often
blocks = st.lists(st.integers(0, 3), min_size=0, max_size=6)
ops = st.lists(st.tuples(st.sampled_from(REPLICAS), blocks), max_size=12)


def chain(seq: list[int]) -> tuple[int, ...]:
    return key_of_pieces([("tokens", [t] * 16) for t in seq]).hashes


def lcp(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def oracle(sent: dict[str, list[tuple]], query: tuple) -> dict[str, int]:
    return {r: max((lcp(query, s) for s in sent.get(r, [])), default=0) for r in REPLICAS}


def check(index, dispatched, query, gone) -> None:
    sent: dict[str, list[tuple]] = {}
    for replica, seq in dispatched:
        index.record(replica, chain(seq))
        sent.setdefault(replica, []).append(chain(seq))
        if hasattr(index, "check_integrity"):
            index.check_integrity()
    assert index.flush(5.0)  # Redis writes are queued for a background thread
    assert index.match(chain(query), REPLICAS) == oracle(sent, chain(query))
    index.forget(gone)
    assert index.flush(5.0)
    sent.pop(gone, None)
    if hasattr(index, "check_integrity"):
        index.check_integrity()
    after = index.match(chain(query), REPLICAS)
    assert after == oracle(sent, chain(query))
    assert after[gone] == 0


@given(ops, blocks, st.sampled_from(REPLICAS))
def test_memory_index_matches_oracle(dispatched, query, gone):
    check(MemoryPrefixIndex(), dispatched, query, gone)


@given(ops, blocks, st.integers(1, 8))
def test_eviction_keeps_integrity_and_only_lowers_matches(dispatched, query, cap):
    """A capped index (a model of a replica cache evicting) never claims more than it was sent."""
    index, full = MemoryPrefixIndex(max_blocks_per_replica=cap), MemoryPrefixIndex()
    for replica, seq in dispatched:
        index.record(replica, chain(seq))
        full.record(replica, chain(seq))
        index.check_integrity()
    capped, uncapped = index.match(chain(query), REPLICAS), full.match(chain(query), REPLICAS)
    assert all(capped[r] <= min(uncapped[r], cap) for r in REPLICAS)


def test_memory_index_evicts_least_recent_blocks():
    index = MemoryPrefixIndex(max_blocks_per_replica=3)
    old, new = chain([1, 1, 1]), chain([2, 2, 2])
    index.record("a", old)
    index.record("a", new)
    assert index.match(old, ["a"]) == {"a": 0} and index.match(new, ["a"]) == {"a": 3}
    assert index.blocks("a") == 3


@pytest.fixture(scope="module")
def redis_url(redis_server) -> str:
    return f"redis://127.0.0.1:{redis_server}/0"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops, blocks, st.sampled_from(REPLICAS))
def test_redis_index_matches_oracle(redis_url, dispatched, query, gone):
    index = RedisPrefixIndex(redis_url, prefix=f"t:{uuid.uuid4().hex}:")
    try:
        check(index, dispatched, query, gone)
    finally:
        index.close()


def test_redis_index_is_shared_and_survives_a_new_client(redis_url):
    """Two ingress routers on one Redis agree; a restarted one (a new client) still knows."""
    prefix = f"t:{uuid.uuid4().hex}:"
    first, second = RedisPrefixIndex(redis_url, prefix=prefix), RedisPrefixIndex(redis_url, prefix=prefix)
    first.record("a", chain([1, 2, 3]))
    assert first.flush(5.0)
    assert second.match(chain([1, 2, 0]), REPLICAS) == {"a": 2, "b": 0, "c": 0}
    first.close()
    second.close()
    third = RedisPrefixIndex(redis_url, prefix=prefix)
    assert third.match(chain([1, 2, 3]), ["a"]) == {"a": 3}
    third.close()


def test_a_busy_replicas_list_of_hashes_keeps_only_live_ones(redis_url):
    """The replica's list of hashes (for forgetting it) had its TTL renewed by every request, so a
    replica busy for days kept every hash it was ever sent (300k: 99 MB, and 3 s to forget it).
    Each record now trims the hashes whose nodes have expired."""
    import time

    import redis

    prefix = f"t:{uuid.uuid4().hex}:"
    index = RedisPrefixIndex(redis_url, prefix=prefix, ttl_s=1)
    try:
        index.record("a", chain(range(1, 101)))
        assert index.flush(5.0)
        time.sleep(1.2)  # those nodes expire
        index.record("a", chain(range(1000, 1100)))
        assert index.flush(5.0)
        assert redis.Redis.from_url(redis_url).zcard(f"{prefix}t:a") == 100
        index.forget("a")
        assert index.flush(5.0)
        assert index.match(chain(range(1000, 1100)), ["a"]) == {"a": 0}
    finally:
        index.close()


def test_redis_down_is_a_miss_not_an_error():
    index = RedisPrefixIndex("redis://127.0.0.1:1/0", timeout_s=0.05)
    try:
        index.record("a", chain([1]))
        assert index.flush(5.0)
        assert index.match(chain([1]), ["a"]) == {"a": 0}
        assert asyncio.run(index.lookup(chain([1]), ["a"])) == {"a": 0}
        index.forget("a")
    finally:
        index.close()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 9), st.booleans()), max_size=30), st.data())
def test_inflight_work_returns_to_zero_in_any_callback_order(requests, data):
    """Each request is routed once and completed once, the completion before or after the
    routing (InflightWork's doc); some replicas die meanwhile. Every count ends at 0."""
    work = InflightWork()
    events = [(i, "routed") for i in range(len(requests))] + [(i, "completed") for i in range(len(requests))]
    order = data.draw(st.permutations(events))
    for i, what in order:
        replica, amount, _ = requests[i]
        if what == "routed":
            work.routed(str(i), replica, amount)
        else:
            work.completed(str(i))
        assert all(v >= 0 for v in work.by_replica.values())
    assert all(v == 0 for v in work.by_replica.values())
    work.forget("ab")
    assert not work.by_replica and not work._requests
