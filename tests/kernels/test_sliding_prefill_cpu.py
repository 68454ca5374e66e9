"""Sliding-layer prefill chunks as query blocks over their own key band (kernels/cpu/sliding_prefill.py),
or as C decode rows (up to NATIVE_SHORT_ROWS_SLIDING rows, any number with a small window), == the torch reference, for any block size,
window, earlier context and batch mix."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.cpu.attention_plan as attention_plan_module
import kernels.cpu.sliding_prefill as sliding
from kernels.attention_ref import paged_attention_ref
from kernels.cpu.attention_plan import AttentionPlan
from kernels.cpu.paged_attention import paged_attention_cpu
from tests.kernels.test_paged_attention_cpu import PAGE, make_batch


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 9),  # block rows
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 30)), min_size=1, max_size=3),
    st.integers(1, 14),  # window
    st.booleans(),  # sinks
    st.booleans(),  # give the step's own keys (k_new / v_new)
    st.booleans(),  # chunks of up to NATIVE_SHORT_ROWS_SLIDING rows as C decode rows (when built)
    st.integers(0, 10_000),
)
def test_blocks_match_the_reference(block, reqs, window, sinks, own_keys, c_rows, seed):
    new_counts = [n for n, _ in reqs]
    ctx_lens = [n + extra for n, extra in reqs]
    q, k, v, table, qsl, lens = make_batch(seed, new_counts, ctx_lens, 4, 2, window, False)
    s = torch.randn(4) if sinks else None
    kw = dict(page_size=PAGE, scale=8**-0.5, window=window, sinks=s)
    extra = {}
    if own_keys:
        rows = []
        for b, (n, length) in enumerate(zip(new_counts, ctx_lens)):
            pos = torch.arange(length - n, length)
            rows.append(table[b][pos // PAGE] * PAGE + pos % PAGE)
        slots = torch.cat(rows)
        extra = dict(k_new=k[slots], v_new=v[slots])
    ref = paged_attention_ref(q, k, v, table, qsl, lens, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sliding, "BLOCK", block)
        if not c_rows:  # chunks stay extends, whatever the window
            mp.setattr(attention_plan_module, "NATIVE_SHORT_ROWS_SLIDING", 1)
            mp.setattr(attention_plan_module, "NATIVE_ANY_ROWS_WINDOW", 0)
        plan = AttentionPlan.build(table, qsl, lens, page_size=PAGE, window=window)
        if not c_rows:
            assert any(e.band is not None for e in plan.extends) == any(n > block for n in new_counts)
        got = paged_attention_cpu(q, k, v, table, qsl, lens, plan=plan, **kw, **extra)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_long_sliding_chunks_take_the_band_and_short_ones_do_not():
    """A chunk longer than a block of a sliding layer is planned as blocks (each over block + W - 1
    keys); a short chunk, or a full-attention layer, keeps one call."""
    q, k, v, table, qsl, lens = make_batch(0, [80, 20], [90, 20], 4, 2, 8, False)
    with pytest.MonkeyPatch.context() as mp:  # 20 rows: not C decode rows here, a short flash chunk
        mp.setattr(attention_plan_module, "NATIVE_SHORT_ROWS_SLIDING", 8)
        mp.setattr(attention_plan_module, "NATIVE_ANY_ROWS_WINDOW", 0)  # W = 8: else all C rows
        plan = AttentionPlan.build(table, qsl, lens, page_size=PAGE, window=8)
    long, short = plan.extends
    assert long.band is not None and short.band is None
    assert long.band.blocks == -(-80 // sliding.BLOCK) and long.band.front_pad == 0  # 10 earlier keys >= W - 1
    assert long.band.mask.shape[-1] == sliding.BLOCK + 8 - 1
    full = AttentionPlan.build(table, qsl, lens, page_size=PAGE, window=None)
    assert all(e.band is None for e in full.extends)


def test_a_fresh_prompt_masks_the_front_padding():
    """With no earlier context the first W - 1 key columns are padding: every block that can see
    them masks them, so the first query attends to itself only."""
    band = sliding.SlidingBand.plan(10, 10, 6, torch.float32, "cpu")
    assert band is None  # not longer than a block
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sliding, "BLOCK", 2)
        band = sliding.SlidingBand.plan(10, 10, 6, torch.float32, "cpu")
    assert band.front_pad == 5 and band.blocks == 5
    visible = torch.isfinite(band.mask[:, 0])  # [blocks, block, span]
    assert visible[0, 0].nonzero().flatten().tolist() == [5]  # row 0: only its own key
    assert visible[1, 0].nonzero().flatten().tolist() == [3, 4, 5]  # row 2: keys 0..2 at columns 5..7 of the pad
