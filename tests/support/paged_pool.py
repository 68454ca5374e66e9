"""What the tests of the C paged decode attention share (tests/kernels/test_paged_decode_native.py,
test_paged_decode_runs.py; their ``width`` fixture is in tests/kernels/conftest.py): a pool of
scattered pages and a step's rows as the kernel's rows."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck

from kernels.native import paged_decode

# the width fixture holds for every generated input of a test (it picks a build, resets nothing)
KEEP_FIXTURE = [HealthCheck.function_scoped_fixture]


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


def rows_plan(table, qsl, lens, page, window, *, chunk_after=0, last=None):
    """Every row of every request a kernel row with its own causal length: what AttentionPlan.build
    makes of short multi-token requests (an MTP verify step, a question after a prefix hit). Runs of
    more than ``chunk_after`` rows go through the chunk path (0: none); ``last``: only the last
    ``last`` rows of request 0 (the same rows with the same lengths, in a shorter run)."""
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
