"""Triton KV store and tier gather/scatter vs the torch references (padding slots, validity masks,
strided inputs, dtype conversion on store). On CPU they run in a TRITON_INTERPRET=1 child."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.kernels.test_kernels_support import DEVICE, interpreter_rerun, kernel_test, run_under_interpreter

from kernels import ops
from kernels.kv_copy_ref import gather_slots_ref, scatter_slots_ref, store_kv_ref
from kernels.kv_copy_triton import gather_slots_triton, scatter_slots_triton, store_kv_triton


@interpreter_rerun
def test_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_under_interpreter(__file__, request.config)


@kernel_test
@settings(max_examples=20, deadline=None)
@given(
    num_slots=st.integers(1, 24), num_tokens=st.integers(0, 10), heads=st.integers(1, 3),
    head_dim=st.sampled_from([4, 24, 40]), v_dim=st.sampled_from([3, 20]), seed=st.integers(0, 2**16),
    cache_dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_store_kv_matches_reference(num_slots, num_tokens, heads, head_dim, v_dim, seed, cache_dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = min(num_tokens, num_slots)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    pad = torch.rand(num_tokens, generator=gen) < 0.3
    slots[pad] = -1  # padding tokens write nothing
    # k and v as strided views of one fused projection, as the attention layer produces them
    fused = torch.randn(num_tokens, heads * (head_dim + v_dim) + 5, generator=gen)
    k = fused[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    v = fused[:, heads * head_dim : heads * (head_dim + v_dim)].view(num_tokens, heads, v_dim)
    k_ref = torch.randn(num_slots, heads, head_dim, generator=gen).to(cache_dtype)
    v_ref = torch.randn(num_slots, heads, v_dim, generator=gen).to(cache_dtype)
    k_dev, v_dev = k_ref.clone().to(DEVICE), v_ref.clone().to(DEVICE)
    store_kv_ref(k_ref, v_ref, slots, k, v)
    store_kv_triton(k_dev, v_dev, slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    assert torch.equal(k_dev.cpu(), k_ref) and torch.equal(v_dev.cpu(), v_ref)


@kernel_test
@settings(max_examples=20, deadline=None)
@given(num_slots=st.integers(1, 20), count=st.integers(0, 12), row_shape=st.sampled_from([(3,), (2, 5), (1, 1300)]),
       with_valid=st.booleans(), seed=st.integers(0, 2**16))
def test_gather_and_scatter_match_reference(num_slots, count, row_shape, with_valid, seed) -> None:
    """Rows of 1300 elements span two 1024-wide programs; masked-out rows read/write nothing."""
    gen = torch.Generator().manual_seed(seed)
    count = min(count, num_slots)
    cache = torch.randn((num_slots,) + row_shape, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:count]
    valid = (torch.rand(count, generator=gen) < 0.6) if with_valid else None
    dev_valid = valid.to(DEVICE) if valid is not None else None

    poisoned = cache.clone()
    if valid is not None:
        poisoned[slots[~valid]] = float("nan")  # an invalid (freed SWA) slot must not be read
    got = gather_slots_triton(poisoned.to(DEVICE), slots.to(DEVICE), dev_valid).cpu()
    assert torch.equal(got, gather_slots_ref(cache, slots, valid))

    rows = torch.randn((count,) + row_shape, generator=gen)
    target_ref, target_dev = cache.clone(), cache.clone().to(DEVICE)
    scatter_slots_ref(target_ref, slots, rows, valid)
    scatter_slots_triton(target_dev, slots.to(DEVICE), rows.to(DEVICE), dev_valid)
    assert torch.equal(target_dev.cpu(), target_ref)


@kernel_test
def test_ops_round_trip_between_tiers() -> None:
    # L1 -> host buffer -> another L1 location: gather then scatter through the dispatch.
    pool = torch.randn(10, 2, 6, device=DEVICE)
    src, dst = torch.tensor([1, 4, 7], device=DEVICE), torch.tensor([9, 0, 2], device=DEVICE)
    valid = torch.tensor([True, False, True], device=DEVICE)
    rows = ops.gather_slots(pool, src, valid)
    expected = pool.clone()
    ops.scatter_slots(pool, dst, rows, valid)
    expected[torch.tensor([9, 2])] = expected[torch.tensor([1, 7])]
    assert torch.equal(pool, expected)
    k_cache, v_cache = torch.zeros(4, 1, 3, device=DEVICE), torch.zeros(4, 1, 2, device=DEVICE)
    ops.store_kv(k_cache, v_cache, torch.tensor([2, -1], device=DEVICE), torch.ones(2, 1, 3, device=DEVICE),
                 torch.ones(2, 1, 2, device=DEVICE))
    assert k_cache.sum().item() == 3 and v_cache[2].sum().item() == 2


def test_wrappers_reject_bad_inputs() -> None:
    cache = torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match="slot_mapping has 1 entries for 2"):
        store_kv_triton(cache, cache.clone(), torch.tensor([0]), torch.zeros(2, 2, 3), torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match="k must be"):
        store_kv_triton(cache, cache.clone(), torch.tensor([0]), torch.zeros(1, 2, 4), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="int32/int64"):
        gather_slots_triton(cache, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="valid must be"):
        gather_slots_triton(cache, torch.tensor([0, 1]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="contiguous"):
        gather_slots_triton(cache.transpose(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="do not fit"):
        scatter_slots_triton(cache, torch.tensor([0]), torch.zeros(1, 3, 2))
