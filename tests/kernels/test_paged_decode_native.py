"""The C paged decode attention (kernels/native/paged_decode.c) == the torch reference: random decode and
mixed batches (GQA, q/k dim != v dim, windows, sinks, released pages, pages of 1-8 tokens), both vector
widths of the source; stale NaN slots never leak; bad page ids and lengths raise; what the kernel cannot
take falls back to the torch path with the same values."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_ref import paged_attention_ref
from kernels.native import build, paged_decode
from kernels.cpu.attention_plan import AttentionPlan
from kernels.cpu.paged_attention import paged_attention_cpu
from tests.support.intra_op import on_threads
from tests.support.paged_pool import KEEP_FIXTURE, pool

pytestmark = pytest.mark.skipif(paged_decode._lib() is None, reason="no C compiler: the torch path serves")


@settings(max_examples=60, deadline=None, suppress_health_check=KEEP_FIXTURE)
@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(0, 70)), min_size=1, max_size=6),
    st.sampled_from([(4, 4), (4, 2), (6, 1), (16, 4), (2, 1)]),
    st.sampled_from([(8, 6), (32, 32), (24, 16), (20, 20), (3, 5)]),
    st.sampled_from([1, 4, 8]),
    st.one_of(st.none(), st.integers(1, 40)),
    st.booleans(), st.booleans(), st.booleans(), st.integers(0, 10_000),
)
def test_matches_reference(width, reqs, heads, dims, page, window, sinks, release, mixed, seed):
    new_counts = [n if mixed and i % 2 else 1 for i, (n, _) in enumerate(reqs)]
    ctx_lens = [n + extra for n, (_, extra) in zip(new_counts, reqs)]
    q, k, v, table, qsl, lens = pool(seed, new_counts, ctx_lens, heads[0], heads[1], dims, page, window, release)
    s = torch.randn(heads[0]) * 2 if sinks else None
    kw = dict(page_size=page, scale=dims[0] ** -0.5, window=window, sinks=s)
    plan = AttentionPlan.build(table, qsl, lens, page_size=page, window=window)
    assert plan.native is not None and plan.decode_slots is None  # the kernel serves, no key grid built
    got = paged_attention_cpu(q, k, v, table, qsl, lens, plan=plan, **kw)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, qsl, lens, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_short_multi_row_requests_are_decode_rows_of_the_kernel_long_chunks_keep_flash(width, window, monkeypatch):
    """An MTP verify step's 1 + k rows (<= NATIVE_SHORT_ROWS; NATIVE_SHORT_ROWS_SLIDING on a sliding
    layer whose window is over NATIVE_ANY_ROWS_WINDOW) become one kernel row per query, each with the
    context up to its own position; a longer chunk stays an extend on the flash kernel."""
    import kernels.cpu.attention_plan as pac
    from kernels.cpu.attention_plan import NATIVE_SHORT_ROWS, NATIVE_SHORT_ROWS_SLIDING

    monkeypatch.setattr(pac, "NATIVE_ANY_ROWS_WINDOW", 0)  # window 5 counts as a large one here
    long = (NATIVE_SHORT_ROWS if window is None else NATIVE_SHORT_ROWS_SLIDING) + 4
    new_counts, ctx_lens = [1, 4, long, NATIVE_SHORT_ROWS], [30, 21, long + 28, 9]
    q, k, v, table, qsl, lens = pool(7, new_counts, ctx_lens, 4, 2, (8, 6), 4, window, True)
    plan = AttentionPlan.build(table, qsl, lens, page_size=4, window=window)
    assert [(e.start, e.end) for e in plan.extends] == [(5, 5 + long)]
    assert plan.decode_rows.tolist() == [0, 1, 2, 3, 4, *range(5 + long, 5 + long + NATIVE_SHORT_ROWS)]
    assert plan.native.seq_lens.tolist() == [30, 18, 19, 20, 21, *range(9 - NATIVE_SHORT_ROWS + 1, 10)]
    kw = dict(page_size=4, scale=0.3, window=window, sinks=torch.randn(4))
    got = paged_attention_cpu(q, k, v, table, qsl, lens, plan=plan, **kw)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, qsl, lens, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [5, 32])
def test_small_window_sends_every_row_of_a_long_chunk_to_the_kernel(width, window):
    """A sliding layer with a window of at most NATIVE_ANY_ROWS_WINDOW: every row of a chunk of any
    length (a whole prompt, earlier context or none) is a kernel row; no extend, no flash band."""
    from kernels.cpu.attention_plan import NATIVE_ANY_ROWS_WINDOW, NATIVE_SHORT_ROWS_SLIDING

    assert window <= NATIVE_ANY_ROWS_WINDOW
    long = NATIVE_SHORT_ROWS_SLIDING * 3 + 5
    new_counts, ctx_lens = [long, 1, long + 40], [long, 50, long + 100]
    q, k, v, table, qsl, lens = pool(3, new_counts, ctx_lens, 4, 2, (8, 6), 4, window, False)
    plan = AttentionPlan.build(table, qsl, lens, page_size=4, window=window)
    assert plan.extends == () and plan.decode_rows.tolist() == list(range(int(qsl[-1])))
    kw = dict(page_size=4, scale=0.3, window=window, sinks=torch.randn(4))
    got = paged_attention_cpu(q, k, v, table, qsl, lens, plan=plan, **kw)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, qsl, lens, **kw), rtol=1e-5, atol=1e-5)
    full = AttentionPlan.build(table, qsl, lens, page_size=4, window=None)  # full layers keep their limit
    assert [(e.start, e.end) for e in full.extends] == [(0, long), (long + 1, 2 * long + 41)]


@settings(max_examples=25, deadline=None, suppress_health_check=KEEP_FIXTURE)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=5), st.one_of(st.none(), st.integers(1, 20)),
       st.integers(0, 10_000))
def test_unwritten_slots_never_leak(width, ctx_lens, window, seed):
    """Every slot no request has written holds NaN (the tail of each last page, the free pages):
    the outputs are finite and equal to the reference's."""
    q, k, v, table, qsl, lens = pool(seed, [1] * len(ctx_lens), ctx_lens, 4, 2, (8, 6), 8, window, True,
                                     fill=float("nan"))
    kw = dict(page_size=8, scale=0.3, window=window, sinks=torch.randn(4))
    got = paged_attention_cpu(q, k, v, table, qsl, lens, **kw)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, qsl, lens, **kw), rtol=1e-5, atol=1e-5)


def test_bad_pages_and_lengths_raise(width):
    q, k, v, table, qsl, lens = pool(0, [1, 1], [12, 7], 2, 2, (8, 8), 4, None, False)
    kw = dict(page_size=4, scale=1.0, window=None)
    released = table.clone()
    released[1, 0] = -1
    with pytest.raises(RuntimeError, match="position 0 whose page was released"):
        paged_attention_cpu(q, k, v, released, qsl, lens, **kw)
    outside = table.clone()
    outside[0, 2] = k.shape[0] // 4  # one past the last page
    with pytest.raises(ValueError, match="position 8 from page .* outside the pool"):
        paged_attention_cpu(q, k, v, outside, qsl, lens, **kw)
    with pytest.raises(ValueError, match="longer than its block table row"):
        paged_attention_cpu(q, k, v, table, qsl, torch.tensor([12, 13]), **kw)
    # a windowed row may leave released pages behind its window: not read, no error
    behind = table.clone()
    behind[0, 0] = -1
    got = paged_attention_cpu(q, k, v, behind, qsl, lens, page_size=4, scale=1.0, window=5)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, behind, qsl, lens, page_size=4, scale=1.0, window=5))


def test_what_the_kernel_cannot_take_keeps_the_torch_path(monkeypatch):
    q, k, v, table, qsl, lens = pool(1, [1, 1, 1], [5, 17, 9], 4, 2, (8, 6), 4, 6, True)
    kw = dict(page_size=4, scale=0.4, window=6, sinks=torch.randn(4))
    ref = paged_attention_ref(q, k, v, table, qsl, lens, **kw)
    plan = AttentionPlan.build(table, qsl, lens, page_size=4, window=6)
    # a pool the kernel does not read (heads not contiguous): the key grid is built on demand
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)
    assert paged_decode.decode_attention(q, k_t, v, plan.native, scale=0.4, sinks=kw["sinks"]) is None
    torch.testing.assert_close(paged_attention_cpu(q, k_t, v, table, qsl, lens, plan=plan, **kw), ref)
    # bf16: no kernel plan at all
    bf = AttentionPlan.build(table, qsl, lens, page_size=4, window=6, dtype=torch.bfloat16)
    assert bf.native is None and bf.decode_slots is not None
    # kernels switched off (engine config / MMSERVE_NATIVE_KERNELS=0)
    monkeypatch.setattr(build, "_enabled", False)
    off = AttentionPlan.build(table, qsl, lens, page_size=4, window=6)
    assert off.native is None
    torch.testing.assert_close(paged_attention_cpu(q, k, v, table, qsl, lens, plan=off, **kw), ref)


def test_a_compiled_step_keeps_the_torch_path(monkeypatch):
    """Inside torch.compile the plan's key grid serves (the C call would split the graph)."""
    q, k, v, table, qsl, lens = pool(2, [1, 1], [9, 3], 4, 2, (8, 8), 4, None, False)
    plan = AttentionPlan.build(table, qsl, lens, page_size=4, window=None, keys=16)
    assert plan.native is not None and plan.decode_slots is not None  # a fixed width: both
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(paged_decode, "decode_attention", lambda *a, **k: pytest.fail("C kernel called"))
    got = paged_attention_cpu(q, k, v, table, qsl, lens, page_size=4, scale=0.3, plan=plan)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, qsl, lens, page_size=4, scale=0.3))


@settings(max_examples=20, deadline=None, suppress_health_check=KEEP_FIXTURE)
@given(st.integers(1, 5), st.integers(1, 4), st.one_of(st.none(), st.integers(1, 12)), st.integers(0, 10_000))
def test_draft_step_plans_match_per_step_reference(width, batch, steps, window, seed):
    """AttentionPlan.decode_steps (MTP draft steps: S steps, some requests idle in some) with the kernel
    == the reference of each step."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(1, 30, (batch,), generator=g)
    lens = base[None, :] + torch.arange(steps)[:, None]
    active = torch.rand(steps, batch, generator=g) < 0.7
    active[:, 0] = True
    rows = [torch.nonzero(a)[:, 0].tolist() for a in active]
    q_all, k, v, table, _, _ = pool(seed, [1] * batch, lens[-1].tolist(), 4, 2, (8, 6), 4, None, False)
    plans = AttentionPlan.decode_steps(table, lens, active, rows, page_size=4, window=window)
    for s, picked in enumerate(rows):
        assert plans[s].native is not None
        idx = torch.tensor(picked)
        q = q_all[idx]
        kw = dict(page_size=4, scale=0.3, window=window, sinks=None)
        qsl = torch.arange(len(picked) + 1)
        got = paged_attention_cpu(q, k, v, table[idx], qsl, lens[s][idx], plan=plans[s], **kw)
        ref = paged_attention_ref(q, k, v, table[idx], qsl, lens[s][idx], **kw)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None, suppress_health_check=KEEP_FIXTURE)
@given(st.lists(st.integers(1, 90) | st.integers(500, 700), min_size=2, max_size=9),
       st.sampled_from([(4, 2), (8, 4), (2, 1)]),
       st.sampled_from([1, 4, 16]), st.one_of(st.none(), st.integers(1, 40)), st.booleans(), st.integers(0, 10_000))
def test_next_request_asked_for_in_slices_is_bit_identical_to_at_once(ctx_lens, heads, page, window, release, seed):
    """The next request's K/V (short contexts) or next block (500+ keys at 4 KV heads: past the
    128 KB asked for whole) asked for a few lines per 4 keys (the default) or all at once
    (-DPAGED_DECODE_BURST_AHEAD, the earlier build): only prefetches differ, so the outputs are equal
    bit for bit -- released pages (skipped by the prefetch) and windows included."""
    q, k, v, table, qsl, lens = pool(seed, [1] * len(ctx_lens), ctx_lens, heads[0], heads[1], (32, 32), page, window,
                                     release)
    plan = AttentionPlan.build(table, qsl, lens, page_size=page, window=window)
    sinks = torch.randn(heads[0])
    spread = paged_decode.decode_attention(q, k, v, plan.native, scale=0.2, sinks=sinks)
    burst_lib = paged_decode._lib(paged_decode.FLAGS + ("-DPAGED_DECODE_BURST_AHEAD",))
    assert burst_lib is not None and burst_lib is not paged_decode._lib()  # really two builds
    with mock.patch.object(paged_decode, "_lib", lambda flags=paged_decode.FLAGS: burst_lib):
        burst = paged_decode.decode_attention(q, k, v, plan.native, scale=0.2, sinks=sinks)
    assert spread is not None and burst is not None
    assert torch.equal(spread, burst)


@settings(max_examples=10, deadline=None)
@given(st.integers(64, 300), st.sampled_from([5, 8, 32]), st.integers(0, 10_000))
def test_a_wide_thread_splits_the_rows_with_the_same_bits(rows, window, seed):
    """A long chunk of a sliding layer (every row a kernel row) on a thread at 2 intra-op threads (the
    engine thread's wide step): the rows split among its team give the one-thread output bit for
    bit; a released page inside a window is still the lowest failing row's error."""
    new_counts, ctx_lens = [rows, 1, rows], [rows, 40, rows + 30]
    q, k, v, table, qsl, lens = pool(seed, new_counts, ctx_lens, 4, 2, (8, 6), 4, window, False)
    plan = AttentionPlan.build(table, qsl, lens, page_size=4, window=window)
    kw = dict(page_size=4, scale=0.3, window=window, sinks=torch.randn(4))
    broken = table.clone()
    broken[2, -1] = -1  # the last request's newest page: every one of its rows sees it

    def run():
        got = paged_attention_cpu(q, k, v, table, qsl, lens, plan=plan, **kw)
        try:
            paged_attention_cpu(q, k, v, broken, qsl, lens, **kw)
            err = None
        except RuntimeError as exc:
            err = str(exc)
        return got, err

    def on(n):
        return on_threads(n, run)

    (one, err1), (two, err2) = on(1), on(2)
    assert torch.equal(one, two)
    assert err1 is not None and err1 == err2
