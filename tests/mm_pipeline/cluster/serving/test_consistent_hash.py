"""Consistent hashing with bounded loads (mm_pipeline/cluster/serving/consistent_hash.py): no replica goes
over the bound whatever the loads, the same key goes to the same replica at equal loads, and removing
a replica moves only the keys it owned."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mm_pipeline.cluster.serving.consistent_hash import BoundedLoadRing

names = st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=1, max_size=8, unique=True)


@given(names, st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=60), st.floats(0.05, 2.0))
def test_no_replica_exceeds_the_bound(replicas, keys, epsilon):
    ring = BoundedLoadRing(replicas, vnodes=16, epsilon=epsilon)
    loads = {r: 0 for r in replicas}
    for k in keys:  # every key is a unit in flight: the hot key repeated included
        cap = ring.capacity(sum(loads.values()))
        r = ring.choose(k, loads)
        assert loads[r] < cap
        loads[r] += 1
        assert max(loads.values()) <= ring.capacity(sum(loads.values()) - 1)


@given(names, st.text(min_size=1))
def test_unloaded_choice_is_the_owner_and_stable(replicas, key):
    ring = BoundedLoadRing(replicas)
    assert ring.choose(key, {}) == ring.owner(key) == BoundedLoadRing(list(reversed(replicas))).owner(key)


@given(names.filter(lambda n: len(n) > 1), st.lists(st.text(min_size=1, max_size=8), max_size=50), st.data())
def test_removing_a_replica_moves_only_its_keys(replicas, keys, data):
    gone = data.draw(st.sampled_from(replicas))
    before, after = BoundedLoadRing(replicas), BoundedLoadRing([r for r in replicas if r != gone])
    for k in keys:
        if before.owner(k) != gone:
            assert after.owner(k) == before.owner(k)


def test_one_hot_key_spreads_over_replicas():
    ring = BoundedLoadRing([f"e{i}" for i in range(4)], epsilon=0.25)
    loads = {f"e{i}": 0 for i in range(4)}
    for _ in range(40):
        loads[ring.choose("hot-video", loads)] += 1
    assert max(loads.values()) <= 13 and sum(loads.values()) == 40


def test_bad_parameters():
    with pytest.raises(ValueError):
        BoundedLoadRing([])
    with pytest.raises(ValueError):
        BoundedLoadRing(["a"], epsilon=0)
