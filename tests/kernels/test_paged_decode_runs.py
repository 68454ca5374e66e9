"""A request's run of rows in the C paged decode attention (kernels/native/paged_decode.c): up to
GROUP_MAX rows sharing their keys as one group with each row's single-row bits (attend_group: an MTP
verify step), longer runs through the chunk path (attend_chunk: a question after a prefix-cache hit,
a prompt's chunk) -- the reference's output, each row's bits its own whatever run or thread split,
the single-row walk's errors, and the plan's routing."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_ref import paged_attention_ref
from kernels.cpu.attention_plan import AttentionPlan
from kernels.native import paged_decode
from tests.support.intra_op import on_threads
from tests.support.paged_pool import KEEP_FIXTURE, pool, rows_plan

pytestmark = pytest.mark.skipif(paged_decode._lib() is None, reason="no C compiler: the torch path serves")


# ---- rows of one request as a group (attend_group) --------------------------------------------------------------

_BUILD = paged_decode._lib  # the builder itself (the width fixture patches _lib with its flags bound)


def _ungrouped_lib(width):
    """The kernel built with no groups (-DGROUP_MAX=1), at the test's vector width: every row walks
    its keys alone."""
    lanes = ("-DPAGED_DECODE_VL8",) if width == "8 lanes" else ()
    lib = _BUILD(paged_decode.FLAGS + paged_decode.openmp_flags() + lanes + ("-DGROUP_MAX=1",))
    assert lib is not None and lib is not paged_decode._lib()  # really two builds
    return lib


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
    rows = rows_plan(table, qsl, lens, page, window)
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
    rows = rows_plan(broken, qsl, lens, 4, None)
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
    plan = rows_plan(table, qsl, lens, 16, None)
    sinks = torch.randn(8)

    def run():
        return paged_decode.decode_attention(q, k, v, plan, scale=0.2, sinks=sinks)

    assert torch.equal(on_threads(1, run), on_threads(2, run))


def test_decode_rows_of_other_requests_with_consecutive_lengths_never_group(width):
    """Three one-row requests of lengths 20, 21, 22 look like one request's rows but read other pages:
    each attends over its own keys."""
    q, k, v, table, qsl, lens = pool(9, [1, 1, 1], [20, 21, 22], 4, 2, (8, 6), 4, None, False)
    rows = rows_plan(table, qsl, lens, 4, None)
    got = paged_decode.decode_attention(q, k, v, rows, scale=0.3, sinks=None)
    ref = paged_attention_ref(q, k, v, table, qsl, lens, page_size=4, scale=0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)



# ---- a request's run of rows as a chunk (attend_chunk) ------------------------------------------------------------

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
    got = paged_decode.decode_attention(q, k, v, rows_plan(table, qsl, lens, page, window, chunk_after=8), scale=scale, sinks=s)
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

    whole = rows_plan(table, qsl, lens, 16, window, chunk_after=8)
    one = on_threads(1, run(whole))
    assert torch.equal(one, on_threads(2, run(whole)))
    tail = on_threads(1, run(rows_plan(table, qsl, lens, 16, window, last=last, chunk_after=8)))
    assert torch.equal(tail[rows - last:], one[rows - last:])
    # and not the single-row walk's bits (another summation order), which the same rows keep at chunk_after 0
    alone = on_threads(1, run(rows_plan(table, qsl, lens, 16, window, chunk_after=0)))
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
                paged_decode.decode_attention(q, k, v, rows_plan(broken, qsl, lens, 4, window, chunk_after=chunk_after),
                                              scale=0.3, sinks=None)
    assert errors[0] == errors[1] and errors[0][1] >= 1  # a row of the chunk (row 0 is the decode row)


def test_the_plan_sends_short_and_fresh_chunks_to_the_chunk_path():
    """AttentionPlan.build: at head dims up to NATIVE_CHUNK_HEAD_DIM a full layer's chunk of up to
    NATIVE_CHUNK_ROWS rows, or of any length over at most NATIVE_CHUNK_KEYS keys, is kernel rows whose
    runs past NATIVE_SHORT_ROWS go as chunks (every row native: the fused layer can take the step);
    larger heads (not measured) keep the flash kernel past NATIVE_SHORT_ROWS; a window under NATIVE_ANY_ROWS_WINDOW
    keys keeps single rows."""
    from kernels.cpu.attention_plan import (NATIVE_ANY_ROWS_WINDOW, NATIVE_CHUNK_HEAD_DIM, NATIVE_CHUNK_KEYS,
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


# ---- the logits rows' plan taken from the step's plan (AttentionPlan.picked) ------------------------------------

@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 90), st.booleans()), min_size=1, max_size=5),
       window=st.sampled_from([None, 8, 32, 128]), seed=st.integers(0, 2**16))
def test_picked_rows_plan_is_the_logits_batch_plan(requests, window, seed):
    """``picked(rows)`` of a step's plan -- for the last row of each request that samples -- equals
    ``build`` over the logits batch (ForwardBatch.logits_batch: those requests' table rows and
    lengths, one new row each), field by field; None where the step's plan has rows outside the
    kernel (a long chunk of a full layer past the kernel's limits)."""
    page = 16
    g = torch.Generator().manual_seed(seed)
    lens = [n + ctx for n, ctx, _ in requests]
    width = max(-(-L // page) for L in lens)
    table = torch.randperm(len(requests) * width, generator=g).reshape(len(requests), width)
    qsl = [0]
    for n, _, _ in requests:
        qsl.append(qsl[-1] + n)
    plan = AttentionPlan.build(table, torch.tensor(qsl), torch.tensor(lens), page_size=page, window=window, head_dim=24)
    sampling = [b for b, (*_, samples) in enumerate(requests) if samples] or [0]
    rows = torch.tensor([qsl[b + 1] - 1 for b in sampling])
    got = plan.picked(rows)
    if not plan.native_every_row:
        assert got is None
        return
    want = AttentionPlan.build(table[sampling], torch.arange(len(sampling) + 1), torch.tensor(lens)[sampling],
                               page_size=page, window=window, head_dim=24)
    assert (got.num_tokens, got.all_decode, got.native_every_row, got.extends) == (
        want.num_tokens, want.all_decode, want.native_every_row, want.extends)
    assert got.decode_slots is want.decode_slots is None and got.decode_mask is want.decode_mask is None
    assert torch.equal(got.decode_rows, want.decode_rows)
    a, b = got.native, want.native
    assert (a.num_tokens, a.page_size, a.window, a.chunk_after) == (b.num_tokens, b.page_size, b.window, b.chunk_after)
    # the kernel reads request i's table row and length through requests[i]: compare what each row sees
    for i in range(len(sampling)):
        ra, rb = int(a.requests[i]), int(b.requests[i])
        assert int(a.rows[i]) == int(b.rows[i])
        assert torch.equal(a.table[ra], b.table[rb]) and int(a.seq_lens[ra]) == int(b.seq_lens[rb])
