"""The CPU paged attention (batched decode rows) == the torch reference on random mixed batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import native
from kernels.attention_ref import paged_attention_ref
from kernels.cpu.paged_attention import paged_attention_cpu

PAGE = 4


def make_batch(seed, new_counts, ctx_lens, heads, kv_heads, window, release):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PAGE) for n in ctx_lens) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for n in ctx_lens:
        pages = [perm.pop() for _ in range(-(-n // PAGE))]
        if release and window is not None:
            # pages wholly behind the first query's window are released (-1), as the engine does
            first_needed = max(0, n - max(new_counts[len(tables)], 1) - window + 1)
            pages = [-1 if (i + 1) * PAGE <= first_needed else p for i, p in enumerate(pages)]
        tables.append(pages)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    k_cache = torch.randn(num_pages * PAGE, kv_heads, 8, generator=g)
    v_cache = torch.randn(num_pages * PAGE, kv_heads, 6, generator=g)
    qsl = torch.tensor([0] + new_counts).cumsum(0)
    q = torch.randn(int(qsl[-1]), heads, 8, generator=g)
    return q, k_cache, v_cache, table, qsl, torch.tensor(ctx_lens)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(0, 20)), min_size=1, max_size=6),
    st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    st.one_of(st.none(), st.integers(1, 12)),
    st.booleans(),
    st.booleans(),
    st.integers(0, 10_000),
)
def test_matches_reference(reqs, heads, window, sinks, release, seed):
    new_counts = [n if i % 2 else 1 for i, (n, _) in enumerate(reqs)]  # mix decode and extend rows
    ctx_lens = [n + extra for n, (_, extra) in zip(new_counts, reqs)]
    q, k, v, table, qsl, lens = make_batch(seed, new_counts, ctx_lens, heads[0], heads[1], window, release)
    s = torch.randn(heads[0]) if sinks else None
    kw = dict(page_size=PAGE, scale=8**-0.5, window=window, sinks=s)
    ref = paged_attention_ref(q, k, v, table, qsl, lens, **kw)
    got = paged_attention_cpu(q, k, v, table, qsl, lens, **kw)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_half_precision_step_stays_in_its_dtype(dtype, sinks):
    """bf16/fp16 in, the same dtype out, with or without sinks (the sink gate is fp32: its product
    was fp32, and a bf16 model's next projection failed on it); values as the fp32 reference's."""
    new_counts, ctx_lens = [1, 5, 3], [7, 9, 3]  # decode, extend over a context, fresh extend
    q, k, v, table, qsl, lens = make_batch(3, new_counts, ctx_lens, 4, 2, None, False)
    s = torch.randn(4) if sinks else None
    kw = dict(page_size=PAGE, scale=8**-0.5, window=None, sinks=s)
    got = paged_attention_cpu(q.to(dtype), k.to(dtype), v.to(dtype), table, qsl, lens, **kw)
    ref = paged_attention_ref(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), table, qsl, lens, **kw)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_reading_a_released_page_raises():
    q, k, v, table, qsl, lens = make_batch(0, [1], [12], 2, 2, None, False)
    table[0, 0] = -1
    with pytest.raises(RuntimeError, match="released"):
        paged_attention_cpu(q, k, v, table, qsl, lens, page_size=PAGE, scale=1.0, window=None)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(1, 16)), st.booleans(), st.integers(0, 10_000))
def test_fresh_chunks_read_the_steps_own_keys(reqs, window, sinks, seed):
    """Prefill chunks given their new keys/values (k_new, v_new) == the reference over the pool:
    chunks with no earlier context take them from k_new (causal mode when the window hides none),
    the others (extra context) still gather from the pool."""
    new_counts = [n for n, _ in reqs]
    ctx_lens = [n + (extra if extra > 1 else 0) for n, extra in reqs]
    q, k, v, table, qsl, lens = make_batch(seed, new_counts, ctx_lens, 4, 2, window, False)
    rows = []
    for b, (n, length) in enumerate(zip(new_counts, ctx_lens)):
        pos = torch.arange(length - n, length)
        rows.append(table[b][pos // PAGE] * PAGE + pos % PAGE)
    slots = torch.cat(rows)
    s = torch.randn(4) if sinks else None
    kw = dict(page_size=PAGE, scale=8**-0.5, window=window, sinks=s)
    got = paged_attention_cpu(q, k, v, table, qsl, lens, k_new=k[slots], v_new=v[slots], **kw)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, qsl, lens, **kw), rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.integers(0, 40), st.sampled_from([(4, 4), (4, 2), (6, 1)]),
       st.one_of(st.none(), st.integers(1, 12)), st.booleans(), st.integers(0, 10_000))
def test_one_request_of_a_few_rows(rows, extra, heads, window, sinks, seed):
    """An MTP verify step at batch 1 (a few query rows of one sequence after its context): the
    reference's result, and bit for bit what the same rows get inside a batch that also holds a decode
    row -- with the C kernel on (one kernel row per query, alone and in the batch) and off (the flash
    single-request path vs the torch general path)."""
    q, k, v, table, qsl, lens = make_batch(seed, [rows, 1], [rows + extra, 5], heads[0], heads[1], window, False)
    s = torch.randn(heads[0]) if sinks else None
    kw = dict(page_size=PAGE, scale=8**-0.5, window=window, sinks=s)
    want = paged_attention_ref(q[:rows], k, v, table[:1], qsl[:2], lens[:1], **kw)
    was = native.enabled()
    try:
        for on in (True, False):
            native.set_enabled(on)
            alone = paged_attention_cpu(q[:rows], k, v, table[:1], qsl[:2], lens[:1], **kw)
            torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(alone, paged_attention_cpu(q, k, v, table, qsl, lens, **kw)[:rows])
    finally:
        native.set_enabled(was)
