"""The C paged decode attention (kernels/native/paged_decode.c) == the torch reference: random decode and
mixed batches (GQA, q/k dim != v dim, windows, sinks, released pages, pages of 1-8 tokens), both vector
widths of the source; stale NaN slots never leak; bad page ids and lengths raise; what the kernel cannot
take falls back to the torch path with the same values."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.attention_ref import paged_attention_ref
from kernels.native import build, paged_decode
from kernels.cpu.paged_attention import AttentionPlan, paged_attention_cpu
from tests.support.intra_op import on_threads

pytestmark = pytest.mark.skipif(paged_decode._lib() is None, reason="no C compiler: the torch path serves")


# the width fixture holds for every generated input of a test (it picks a build, resets nothing)
KEEP_FIXTURE = [HealthCheck.function_scoped_fixture]


@pytest.fixture(params=["native width", "8 lanes"])
def width(request, monkeypatch):
    """Each test runs on the host's vector width and on the 8-lane form (AVX2 hosts, other CPUs)."""
    if request.param == "8 lanes":
        monkeypatch.setattr(paged_decode, "_lib",
                            functools.partial(paged_decode._lib, paged_decode.FLAGS + ("-DPAGED_DECODE_VL8",)))
    return request.param


def pool(seed, new_counts, ctx_lens, heads, kv_heads, dims, page, window, release, fill=None):
    """A pool whose unused slots hold ``fill`` (random when None), each request's pages scattered."""
    g = torch.Generator().manual_seed(seed)
    dqk, dv = dims
    num_pages = sum(-(-n // page) for n in ctx_lens) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for b, n in enumerate(ctx_lens):
        pages = [perm.pop() for _ in range(-(-n // page))]
        if release and window is not None:  # pages wholly behind the window released, as the engine does
            first_needed = max(0, n - new_counts[b] - window + 1)
            pages = [-1 if (i + 1) * page <= first_needed else p for i, p in enumerate(pages)]
        tables.append(pages)
    width_ = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width_ - len(t)) for t in tables])
    k = torch.randn(num_pages * page, kv_heads, dqk, generator=g)
    v = torch.randn(num_pages * page, kv_heads, dv, generator=g)
    if fill is not None:  # only the written positions hold values
        written = torch.zeros(num_pages * page, dtype=torch.bool)
        for b, n in enumerate(ctx_lens):
            pos = torch.arange(n)
            pages = table[b][pos // page]
            written[(pages * page + pos % page)[pages >= 0]] = True
        k[~written], v[~written] = fill, fill
    qsl = torch.tensor([0] + new_counts).cumsum(0)
    # q as the projection hands it over: a view with a longer row stride than its heads
    q = torch.randn(int(qsl[-1]), heads + kv_heads, dqk, generator=g)[:, :heads]
    return q, k, v, table, qsl, torch.tensor(ctx_lens)


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
    import kernels.cpu.paged_attention as pac
    from kernels.cpu.paged_attention import NATIVE_SHORT_ROWS, NATIVE_SHORT_ROWS_SLIDING

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
    from kernels.cpu.paged_attention import NATIVE_ANY_ROWS_WINDOW, NATIVE_SHORT_ROWS_SLIDING

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


# ---- rows of one request as a group (attend_group) --------------------------------------------------------------

_BUILD = paged_decode._lib  # the builder itself (the width fixture patches _lib with its flags bound)


def _ungrouped_lib(width):
    """The kernel built with no groups (-DGROUP_MAX=1), at the test's vector width: every row walks
    its keys alone."""
    lanes = ("-DPAGED_DECODE_VL8",) if width == "8 lanes" else ()
    lib = _BUILD(paged_decode.FLAGS + paged_decode.openmp_flags() + lanes + ("-DGROUP_MAX=1",))
    assert lib is not None and lib is not paged_decode._lib()  # really two builds
    return lib


def _rows_plan(table, qsl, lens, page, window):
    """Every row of every request a kernel row with its own causal length: what AttentionPlan.build
    makes of short multi-token requests (an MTP verify step, a question after a prefix hit)."""
    requests, row_lens = [], []
    bounds = qsl.tolist()
    for b, n in enumerate(lens.tolist()):
        rows = bounds[b + 1] - bounds[b]
        requests += [b] * rows
        row_lens += range(n - rows + 1, n + 1)
    return paged_decode.DecodeRows.build(table.index_select(0, torch.tensor(requests)), torch.tensor(row_lens),
                                         list(range(len(requests))), list(range(len(requests))),
                                         num_tokens=len(requests), page_size=page, window=window)


@settings(max_examples=40, deadline=None, suppress_health_check=KEEP_FIXTURE)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 120)), min_size=1, max_size=4),
       st.sampled_from([(4, 4), (4, 2), (6, 1), (8, 8)]), st.sampled_from([(8, 6), (24, 16), (3, 5)]),
       st.sampled_from([1, 4, 16]), st.one_of(st.none(), st.integers(1, 200)), st.booleans(), st.integers(0, 10_000))
def test_rows_of_one_request_go_as_a_group_with_the_bits_of_each_row_alone(width, reqs, heads, dims, page, window,
                                                                          sinks, seed):
    """Rows of one request sharing their first key (no window, or a window none of them has filled)
    read the keys once for all of them, each query masked to its own keys: the output is the
    ungrouped build's bit for bit, decode rows of other requests beside them, and the reference's."""
    new_counts = [n for n, _ in reqs]
    ctx_lens = [n + extra for n, extra in reqs]
    q, k, v, table, qsl, lens = pool(seed, new_counts, ctx_lens, heads[0], heads[1], dims, page, window, True)
    rows = _rows_plan(table, qsl, lens, page, window)
    s = torch.randn(heads[0]) * 2 if sinks else None
    grouped = paged_decode.decode_attention(q, k, v, rows, scale=0.3, sinks=s)
    lib = _ungrouped_lib(width)
    with mock.patch.object(paged_decode, "_lib", lambda flags=None: lib):
        alone = paged_decode.decode_attention(q, k, v, rows, scale=0.3, sinks=s)
    assert grouped is not None and alone is not None
    assert torch.equal(grouped, alone)
    ref = paged_attention_ref(q, k, v, table, qsl, lens, page_size=page, scale=0.3, window=window, sinks=s)
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("broken_at", [3, 21, 26])
def test_a_group_reports_the_row_a_single_row_walk_fails_on_first(width, broken_at):
    """A released page under a group: the error names the row (request) and position the ungrouped
    walk names -- row 0 at the lowest bad position when row 0 sees it, else the first row whose keys
    reach it (the group's newest page is seen by its later rows only)."""
    q, k, v, table, qsl, lens = pool(4, [1, 9], [30, 28], 4, 2, (8, 6), 4, None, False)
    broken = table.clone()
    broken[1, broken_at // 4] = -1
    rows = _rows_plan(broken, qsl, lens, 4, None)
    lib = _ungrouped_lib(width)
    errors = []
    for use in (paged_decode._lib(), lib):
        with mock.patch.object(paged_decode, "_lib", lambda flags=None, use=use: use):
            with pytest.raises(RuntimeError, match="whose page was released") as err:
                paged_decode.decode_attention(q, k, v, rows, scale=0.3, sinks=None)
        errors.append(str(err.value))
    assert errors[0] == errors[1]


@settings(max_examples=10, deadline=None)
@given(st.integers(9, 40), st.integers(300, 1200), st.integers(0, 10_000))
def test_a_short_call_with_enough_work_splits_on_a_wide_thread_with_the_same_bits(rows, ctx, seed):
    """Fewer rows than PARALLEL_ROWS whose keys make enough work (team.h SPLIT_MACS: a question after a
    prefix-cache hit over a long full-attention context) split among a wide thread's team: the
    one-thread output bit for bit."""
    q, k, v, table, qsl, lens = pool(seed, [rows, 1], [ctx + rows, 50], 8, 8, (24, 16), 16, None, False)
    plan = _rows_plan(table, qsl, lens, 16, None)
    sinks = torch.randn(8)

    def run():
        return paged_decode.decode_attention(q, k, v, plan, scale=0.2, sinks=sinks)

    assert torch.equal(on_threads(1, run), on_threads(2, run))


def test_decode_rows_of_other_requests_with_consecutive_lengths_never_group(width):
    """Three one-row requests of lengths 20, 21, 22 look like one request's rows but read other pages:
    each attends over its own keys."""
    q, k, v, table, qsl, lens = pool(9, [1, 1, 1], [20, 21, 22], 4, 2, (8, 6), 4, None, False)
    rows = _rows_plan(table, qsl, lens, 4, None)
    got = paged_decode.decode_attention(q, k, v, rows, scale=0.3, sinks=None)
    ref = paged_attention_ref(q, k, v, table, qsl, lens, page_size=4, scale=0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)



# ---- a request's run of rows as a chunk (attend_chunk) ------------------------------------------------------------

def _chunk_plan(table, qsl, lens, page, window, *, chunk_after=8, last=None):
    """_rows_plan with runs of more than ``chunk_after`` rows through the chunk path (0: none); ``last``:
    only the last ``last`` rows of request 0 (the same rows with the same lengths, in a shorter run)."""
    requests, row_lens, q_rows = [], [], []
    bounds = qsl.tolist()
    for b, n in enumerate(lens.tolist()):
        rows = bounds[b + 1] - bounds[b]
        keep = range(rows - last, rows) if b == 0 and last is not None else range(rows)
        requests += [b] * len(keep)
        row_lens += [n - rows + 1 + i for i in keep]
        q_rows += [bounds[b] + i for i in keep]
    return paged_decode.DecodeRows.build(table.index_select(0, torch.tensor(requests)), torch.tensor(row_lens),
                                         list(range(len(requests))), q_rows, num_tokens=int(bounds[-1]),
                                         page_size=page, window=window, chunk_after=chunk_after)


@settings(max_examples=40, deadline=None, suppress_health_check=KEEP_FIXTURE)
@given(st.integers(9, 80), st.integers(0, 300), st.lists(st.integers(1, 40), max_size=3),
       st.sampled_from([(8, 4), (4, 2), (6, 1), (8, 8), (12, 4)]),
       st.sampled_from([(24, 16), (8, 6), (32, 32), (3, 5), (40, 20), (192, 128)]),
       st.sampled_from([1, 4, 16]), st.one_of(st.none(), st.integers(1, 200)), st.booleans(), st.integers(0, 10_000))
def test_a_chunk_of_rows_matches_the_reference(width, rows, ctx, decodes, heads, dims, page, window, sinks, seed):
    """A request's run of more rows than chunk_after (a question after a prefix-cache hit, a prompt's
    chunk) through the chunk path: the reference's output to fp32 rounding, with or without a window
    (pages behind it released), decode rows of other requests beside it, head sizes that are not a
    multiple of the vector width and MiMo-V2.5's, KV groups of one head, of pairs and of an odd count
    (the last head alone)."""
    q, k, v, table, qsl, lens = pool(seed, [rows] + [1] * len(decodes), [ctx + rows] + [d + 1 for d in decodes],
                                     heads[0], heads[1], dims, page, window, True)
    s = torch.randn(heads[0]) * 2 if sinks else None
    scale = dims[0] ** -0.5  # the model's: O(1) logits at any head size (a fixed 0.3 gives 192-dim logits of
    # std ~4, whose fp32 rounding alone reaches 2e-5 in an output)
    got = paged_decode.decode_attention(q, k, v, _chunk_plan(table, qsl, lens, page, window), scale=scale, sinks=s)
    ref = paged_attention_ref(q, k, v, table, qsl, lens, page_size=page, scale=scale, window=window, sinks=s)
    assert got is not None
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(st.integers(20, 90), st.integers(0, 400), st.integers(9, 19), st.one_of(st.none(), st.integers(32, 100)),
       st.integers(0, 10_000))
def test_a_chunk_row_computes_the_same_bits_in_any_run_and_thread_split(rows, ctx, last, window, seed):
    """A row of a chunk computes the same bits whatever it goes with: the whole run on one thread, on
    a wide thread's team (the rows split into ranges), or only the run's last rows -- its blocks of keys
    lie at absolute positions and it takes only its own keys of each."""
    q, k, v, table, qsl, lens = pool(seed, [rows], [ctx + rows], 8, 4, (24, 16), 16, window, True)
    sinks = torch.randn(8)

    def run(plan):
        return lambda: paged_decode.decode_attention(q, k, v, plan, scale=0.2, sinks=sinks)

    whole = _chunk_plan(table, qsl, lens, 16, window)
    one = on_threads(1, run(whole))
    assert torch.equal(one, on_threads(2, run(whole)))
    tail = on_threads(1, run(_chunk_plan(table, qsl, lens, 16, window, last=last)))
    assert torch.equal(tail[rows - last:], one[rows - last:])
    # and not the single-row walk's bits (another summation order), which the same rows keep at chunk_after 0
    alone = on_threads(1, run(_chunk_plan(table, qsl, lens, 16, window, chunk_after=0)))
    torch.testing.assert_close(one, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("broken_at", [3, 21, 40, 47])
@pytest.mark.parametrize("window", [None, 36])
def test_a_chunk_reports_the_row_and_position_a_single_row_walk_does(width, broken_at, window):
    """A released page under a chunk: the error names the request and position the single-row walk
    names -- the lowest bad position the chunk's rows see, from the first row whose keys reach it."""
    q, k, v, table, qsl, lens = pool(4, [1, 20], [30, 48], 4, 2, (8, 6), 4, None, False)
    broken = table.clone()
    broken[1, broken_at // 4] = -1
    errors, raise_ = [], paged_decode._raise

    def seen(status, decode, row, pos, num_slots):
        errors.append((status, row, pos))
        raise_(status, decode, row, pos, num_slots)

    with mock.patch.object(paged_decode, "_raise", seen):
        for chunk_after in (8, 0):
            with pytest.raises(RuntimeError, match="whose page was released"):
                paged_decode.decode_attention(q, k, v, _chunk_plan(broken, qsl, lens, 4, window, chunk_after=chunk_after),
                                              scale=0.3, sinks=None)
    assert errors[0] == errors[1] and errors[0][1] >= 1  # a row of the chunk (row 0 is the decode row)


def test_the_plan_sends_short_and_fresh_chunks_to_the_chunk_path():
    """AttentionPlan.build: at head dims up to NATIVE_CHUNK_HEAD_DIM a full layer's chunk of up to
    NATIVE_CHUNK_ROWS rows, or of any length over at most NATIVE_CHUNK_KEYS keys, is kernel rows whose
    runs past NATIVE_SHORT_ROWS go as chunks (every row native: the fused layer can take the step);
    larger heads (not measured) keep the flash kernel past NATIVE_SHORT_ROWS; a window under NATIVE_ANY_ROWS_WINDOW
    keys keeps single rows."""
    from kernels.cpu.paged_attention import (NATIVE_ANY_ROWS_WINDOW, NATIVE_CHUNK_HEAD_DIM, NATIVE_CHUNK_KEYS,
                                             NATIVE_CHUNK_ROWS, NATIVE_SHORT_ROWS)

    def plan(rows, head_dim, window=None, ctx=1000):
        _, _, _, table, qsl, lens = pool(1, [rows, 1], [ctx + rows, 40], 8, 4, (24, 16), 16, None, False)
        return AttentionPlan.build(table, qsl, lens, page_size=16, window=window, head_dim=head_dim)

    small = plan(29, NATIVE_CHUNK_HEAD_DIM)
    assert small.native_every_row and not small.extends and small.native.chunk_after == NATIVE_SHORT_ROWS
    assert plan(NATIVE_CHUNK_ROWS, 24).native_every_row
    assert len(plan(NATIVE_CHUNK_ROWS + 1, 24).extends) == 1
    fresh = plan(NATIVE_CHUNK_KEYS, 24, ctx=0)  # a fresh prompt's chunk: its keys are its rows
    assert fresh.native_every_row and fresh.native.chunk_after == NATIVE_SHORT_ROWS
    assert len(plan(NATIVE_CHUNK_KEYS - 10, 24, ctx=11).extends) == 1  # one key past the limit
    assert len(plan(NATIVE_CHUNK_KEYS, NATIVE_CHUNK_HEAD_DIM + 1, ctx=0).extends) == 1
    large = plan(29, NATIVE_CHUNK_HEAD_DIM + 1)
    assert len(large.extends) == 1 and not large.native_every_row
    assert plan(29, None).extends  # head size unknown: no chunk path
    assert plan(29, 24, window=NATIVE_ANY_ROWS_WINDOW).native.chunk_after == NATIVE_SHORT_ROWS
    assert plan(29, 24, window=NATIVE_ANY_ROWS_WINDOW - 1).native.chunk_after == 0
