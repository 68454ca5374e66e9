"""Dual KV pool: allocator invariants, per-layer buffers of the right pool, exact byte accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.kvcache.dual_pool import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DualKVPool,
    KVHeadSpec,
    KVLayout,
    PageAllocator,
    PoolExhausted,
    PoolSizing,
    available_memory_bytes,
    default_kv_budget_bytes,
    swa_tokens_needed,
)

# MiMo-V2.5 geometry (docs/model.md §1.1): 9 full layers (4 KV heads), 39 sliding (8 KV heads).
MIMO_KINDS = tuple("full" if i == 0 or (i + 1) % 6 == 0 else "sliding" for i in range(48))
MIMO = KVLayout(MIMO_KINDS, KVHeadSpec(4, 192, 128), KVHeadSpec(8, 192, 128), window=128)
TINY = KVLayout(("full", "sliding", "sliding", "full"), KVHeadSpec(2, 8, 4), KVHeadSpec(4, 8, 4), window=6)


def test_layout_counts_mimo_layers():
    assert MIMO.full_layers == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert len(MIMO.swa_layers) == 39


def test_layout_rejects_bad_kind_and_missing_window():
    with pytest.raises(ValueError, match="layer kinds"):
        KVLayout(("full", "global"), KVHeadSpec(1, 2, 2), KVHeadSpec(1, 2, 2), 4)
    with pytest.raises(ValueError, match="window"):
        KVLayout(("sliding",), KVHeadSpec(1, 2, 2), KVHeadSpec(1, 2, 2), None)


def test_bytes_per_token_match_hand_count():
    # bf16: full 9 layers x 4 heads x (192+128) x 2 bytes; SWA 39 x 8 x 320 x 2
    assert MIMO.full_bytes_per_token(torch.bfloat16) == 9 * 4 * 320 * 2
    assert MIMO.swa_bytes_per_token(torch.bfloat16) == 39 * 8 * 320 * 2


def test_meta_pool_reports_real_bytes_without_allocating():
    pool = DualKVPool(MIMO, num_full_tokens=1 << 20, num_swa_tokens=4096, page_size=64,
                      dtype=torch.bfloat16, device="meta")
    assert pool.full_bytes == (1 << 20) * MIMO.full_bytes_per_token(torch.bfloat16)
    assert pool.swa_bytes == 4096 * MIMO.swa_bytes_per_token(torch.bfloat16)
    assert pool.layer(0)[0].device.type == "meta"


def test_layer_returns_buffer_of_its_kind():
    pool = DualKVPool(TINY, num_full_tokens=40, num_swa_tokens=16, page_size=4)
    k0, v0 = pool.layer(0)
    k1, v1 = pool.layer(1)
    assert k0.shape == (40, 2, 8) and v0.shape == (40, 2, 4)
    assert k1.shape == (16, 4, 8) and v1.shape == (16, 4, 4)
    assert pool.layer(1)[0] is not pool.layer(2)[0]  # every layer has its own buffer
    assert pool.full.num_pages == 10 and pool.swa.num_pages == 4


def test_pool_rejects_sizes_below_one_page():
    with pytest.raises(ValueError, match="Full pool"):
        DualKVPool(TINY, num_full_tokens=3, num_swa_tokens=16, page_size=4)
    with pytest.raises(ValueError, match="SWA pool"):
        DualKVPool(TINY, num_full_tokens=16, num_swa_tokens=0, page_size=4)


def test_swa_need_follows_the_formula():
    need = swa_tokens_needed(MIMO, page_size=64, max_num_seqs=8, max_num_batched_tokens=2048,
                             swa_release_interval=16, checkpoint_reserve_windows=10)
    # 8 x (window 128 + 16 decode slack + 2 pages) + one step's 2048 tokens + 10 x (2 pages + 1 page)
    assert need == 8 * (128 + 16 + 128) + 2048 + 10 * 192
    assert swa_tokens_needed(TINY, page_size=4, max_num_seqs=3, max_num_batched_tokens=5,
                             swa_release_interval=2) == 3 * (6 + 2 + 8) + 8  # 5 rounded up to a page
    no_swa = KVLayout(("full", "full"), KVHeadSpec(1, 2, 2), KVHeadSpec(1, 2, 2), None)
    assert swa_tokens_needed(no_swa, page_size=4, max_num_seqs=3, max_num_batched_tokens=5,
                             swa_release_interval=2, checkpoint_reserve_windows=9) == 0


def test_sizing_from_bytes_gives_swa_its_need_and_full_the_rest():
    budget = 8 << 30
    s = PoolSizing.from_bytes(MIMO, budget, dtype=torch.bfloat16, page_size=64, swa_tokens=10_000)
    swa_b = s.num_swa_tokens * MIMO.swa_bytes_per_token(torch.bfloat16)
    full_b = s.num_full_tokens * MIMO.full_bytes_per_token(torch.bfloat16)
    assert s.num_swa_tokens == 10_048  # rounded up to whole pages
    assert swa_b + full_b <= budget
    assert budget - (swa_b + full_b) < 64 * MIMO.full_bytes_per_token(torch.bfloat16)  # < one page left
    capped = PoolSizing.from_bytes(MIMO, budget, dtype=torch.bfloat16, page_size=64, swa_tokens=10_000,
                                   max_full_tokens=1000)
    assert (capped.num_full_tokens, capped.num_swa_tokens) == (1024, 10_048)  # the model's use, whole pages
    with pytest.raises(ValueError, match="too small"):
        PoolSizing.from_bytes(MIMO, 1000, dtype=torch.bfloat16, page_size=64, swa_tokens=10_000)


def test_default_budget_is_a_fixed_space_on_cpu_and_a_fraction_on_cuda(monkeypatch):
    assert default_kv_budget_bytes("cpu", 0.5) == DEFAULT_CPU_KV_CACHE_BYTES  # not a share of free RAM
    monkeypatch.setattr("llm_core.kvcache.dual_pool.available_memory_bytes", lambda device: 10 << 30)
    assert default_kv_budget_bytes("cuda", 0.25) == (10 << 30) // 4
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        available_memory_bytes("cpu")


def test_allocator_errors_name_the_problem():
    a = PageAllocator(2, "Full")
    pages = a.allocate(2)
    with pytest.raises(PoolExhausted, match="Full pool: 1 pages wanted, 0 free"):
        a.allocate(1)
    a.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        a.free([pages[0]])
    with pytest.raises(RuntimeError, match="incref of free page"):
        a.incref([pages[0]])


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 5)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_allocator_random_sequences_keep_refcounts_exact(seq):
    """Model the owners explicitly: every page's refcount == number of owners holding it."""
    a = PageAllocator(12, "SWA")
    owners: list[list[int]] = []
    for op, n in seq:
        if op == "alloc":
            if n <= a.num_free:
                owners.append(a.allocate(n))
            else:
                with pytest.raises(PoolExhausted):
                    a.allocate(n)
        elif op == "free" and owners:
            a.free(owners.pop(n % len(owners)))
        elif op == "share" and owners:
            pages = owners[n % len(owners)]
            a.incref(pages)
            owners.append(list(pages))
        a.check_integrity()
        held = [p for o in owners for p in o]
        for p in range(a.num_pages):
            assert a.refcount(p) == held.count(p)
        assert a.num_used == len(set(held))
    for o in owners:
        a.free(o)
    assert a.num_free == a.num_pages
    a.check_integrity()
