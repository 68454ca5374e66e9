"""The index work of one step's CPU paged attention (kernels/cpu/paged_attention.py), done once per step
and pool and shared by every layer of that kind, and where each request's rows go.

The reference (:func:`kernels.attention_ref.paged_attention_ref`) loops over requests in Python and
builds its gather indices in every layer; on a CPU decode step that bookkeeping, not the math, is the
cost. An :class:`AttentionPlan` holds every index tensor of one step and one pool (it depends only on
the page table, the lengths and the window):

  decode rows (one new token each) -- one padded batch:

    request b, context L_b, first visible key f_b = max(0, L_b - window)  (0 without window)
    key grid [D, Kmax]:   pos[b, j] = f_b + j  while j < L_b - f_b, else L_b - 1 (masked out)
        b=0  L=5   |0 1 2 3 4 4 4|       padding re-reads the request's own newest key: a slot
        b=1  L=7   |0 1 2 3 4 5 6|       that is always written, so no NaN/garbage can leak in
    slots = table[b, pos // P] * P + pos % P,   mask[b, j] = 0 or -inf

  extend rows (a prefill chunk of n tokens) -- one call per request over keys [first, L) with the
  causal (and window) mask of its n queries. A chunk whose visible keys are all its own new tokens
  (a fresh prompt's first chunk: no earlier context, or one wholly behind the window) reads them
  straight from the step's k / v instead of gathering them back from the pool, and when the window
  hides none of them it runs the kernel's causal mode (no mask tensor; the kernel skips the blocks
  above the diagonal) -- what transformers' SDPA path does for a single-sequence prefill. A chunk
  longer than a block of a sliding layer runs as query blocks, each over the keys its rows can
  reach (kernels/cpu/sliding_prefill.py): W keys per query, not the whole chunk.

Decode rows in fp32 go to the C kernel instead (kernels/native/paged_decode.c, when built and on):
one call per layer reads each request's keys in place through the block table, so the plan then
carries the block table, lengths and decode rows (``native``) and no key grid or mask. So do the
prefill rows the limits below send there (a short chunk, a fresh prompt's chunk, every row of a
small window). A compiled step keeps the grid (asked for with a fixed ``keys`` width), and so do
bf16 and a switched-off build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu.sliding_prefill import SlidingBand
from kernels.host_index import long_tensor
from kernels.native import paged_decode

# multi-token requests of at most this many query rows (an MTP verify step's 1 + k, a short chunk) go
# to the C decode kernel as one decode row per query when it serves the step: one call per layer
# instead of a gather and a flash call per request (MTP at batch 8 on the demo model: 1.21x -> 1.75x
# over plain decode, medians of 3). A lone request too (MTP at batch 1): the kernel reads its keys once
# per row where one flash call reads them once, but the flash call's fixed cost (gather, mask, a
# padded head size) is larger up to 8 rows: demo-model shapes, plan + 3 layers per pool, 4 rows over
# 400 keys 0.22 vs 0.35 ms full attention, 0.10 vs 0.31 ms windowed; 8 rows over 2000 keys 1.05 vs
# 1.15 ms full (docs/speculative.md). The kernel now takes a request's rows as one group that reads
# the keys once for all of them (paged_decode.c attend_group, each row's bits unchanged): MTP at batch
# 1 on the demo model 1.37x -> 1.64x over plain decode (speculative.py --quick, one run each). Longer
# chunks of a full layer keep the flash kernel where the chunk path below does not pay: at 29 rows
# over ~1,100 keys (the pipeline benchmark's same-prefix step, 8 heads of 24) the group's dot products
# (a horizontal sum per 4 keys, the decode rows' own order, kept for their bits) lose to flash, 1.74
# vs 1.14 ms at one thread, 0.99 vs 0.90 at two
NATIVE_SHORT_ROWS = 8
# The same for a sliding layer, whose rows each read at most W keys: up to 64 rows (a question after a
# prefix-cache hit). CPU ms per layer, flash -> C rows, 27 rows after 393 cached tokens: W = 8, demo
# heads 0.144 -> 0.058; W = 128, demo heads 0.227 -> 0.286; W = 128, MiMo-V2.5's 64 heads of 192
# over 2000 keys 4.82 -> 3.06 (full attention there 47.8 -> 43.2, but 0.467 -> 0.747 on demo heads,
# so full layers keep the lower limit)
NATIVE_SHORT_ROWS_SLIDING = 64
# A sliding layer whose window is at most this sends every row of any chunk to the C kernel: each row
# reads its W keys in place, where the flash band (kernels/cpu/sliding_prefill.py) computes BLOCK + W - 1
# logits per row at the flash call's fixed cost. Plan + 4 layers, one thread, CPU ms, band -> C rows
# (benchmarks/sliding_rows.py): 376 fresh rows at W = 8 on the pipeline benchmark's heads (8 / 8 of 24)
# 5.40 -> 2.02, on the demo model's (4 / 2 of 32) 1.83 -> 0.94; at W = 32 (the demo model) 4.79 -> 4.16
# and 2.31 -> 1.36; 120 rows after 300 at W = 32 1.08 -> 0.51. At W = 128 the band wins (8.30 -> 14.12,
# 4.08 -> 4.61), so larger windows keep the row limit above.
NATIVE_ANY_ROWS_WINDOW = 32
# At head dims up to NATIVE_CHUNK_HEAD_DIM the C kernel also takes a full layer's chunk of up to
# NATIVE_CHUNK_ROWS rows, and its runs of more than NATIVE_SHORT_ROWS rows (on a full layer, or a
# sliding one of at least NATIVE_ANY_ROWS_WINDOW keys) go through the kernel's chunk path
# (paged_decode.c attend_chunk: each block's keys transposed once for all the rows' queries; a row's
# bits its own whatever the thread split, not the single-row walk's). Every row of such a step is then
# a kernel row, so a short step's layers run as one C call each (llm_core/model/layers/fused_decode.py).
# benchmarks/chunk_rows.py (plan + one layer, wall ms per call, medians; flash / C rows / chunk at one
# thread | at two), on the AVX2 EPYC: the same-prefix step's full layer (29 rows after 1,088, 8 / 4
# heads of 24 / 16) 1.07 / 1.24 / 0.88 | 0.76 / 0.73 / 0.56; the demo model's heads (4 / 2 of 32)
# 0.67 / 0.81 / 0.56 | 0.81 / 0.55 / 0.48; MiMo-V2.5's full layer (64 / 4 heads of 192 / 128), 29
# rows after 2,000: 54.0 / 57.4 / 41.8 | 26.3 / 29.4 / 21.7, 64 rows after 2,000: 98.8 / 128.6 / 92.6
# | 56.4 / 65.9 / 56.0; its sliding layer (64 / 8, W = 128), 64 rows after 2,000: 12.1 / 14.1 / 9.3 |
# 7.2 / 7.1 / 4.9; 8 / 4 of 128: 2.88 / 3.49 / 2.67 | 1.98 / 1.97 / 1.89. Two heads of a KV head's
# group share every K and V load, which is what lets it keep up at large groups (16 / 4 of 64 is
# within noise either way: 2.84 vs 3.09, 2.01 vs 1.80). At W = 8 a row's eight dot products cost
# what a block of 32 logits does (376 rows: 0.79 vs 0.77, 0.66 vs 0.68), so small windows keep rows.
# Larger heads than MiMo-V2.5's 192 were not measured, and keep flash past NATIVE_SHORT_ROWS.
NATIVE_CHUNK_ROWS = 64
NATIVE_CHUNK_HEAD_DIM = 192
# ... and a longer chunk of a full layer whose rows see at most this many keys (a fresh prompt's chunk,
# one after a short context): the team's threads split the rows at equal shares of their keys
# (paged_decode.c share_start), so a causal chunk's later rows no longer load one thread. Flash / chunk
# at one thread | two, 8 / 4 heads of 24: 376 fresh rows 2.65 / 1.96 | 1.86 / 1.24, 512 fresh 4.68 /
# 3.80 | 2.90 / 2.14; MiMo-V2.5's full layer, 512 fresh rows 173 / 122 | 99.6 / 64.0. Past it the two
# come level (512 rows after 2,048: 25.3 / 24.3 | 13.5 / 12.5; 4 / 2 of 32, 256 after 4,096: 12.4 /
# 14.1 | 6.8 / 7.4).
NATIVE_CHUNK_KEYS = 1024


@dataclass(frozen=True)
class Extend:
    """One multi-token request: its query rows and the keys they may see."""

    start: int  # first flat query row
    end: int
    slots: torch.Tensor  # [K] pool slot of each key position first .. L-1
    mask: torch.Tensor | None  # [1, 1, n, K] additive (0 / -inf), causal + window; None: causal mode
    fresh: bool  # keys first .. L-1 are exactly this chunk's new tokens (read from k / v, not the pool)
    band: SlidingBand | None = None  # a long chunk of a sliding layer: query blocks over their own keys


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors of one step over one pool (one page table and window); shared by its layers."""

    num_tokens: int
    decode_rows: torch.Tensor | None  # [D] flat query row of each decode request (None: no decode rows)
    all_decode: bool  # every flat row is a decode row, in order (no scatter needed)
    decode_slots: torch.Tensor | None  # [D * Kmax] flat pool slots of the key grid
    decode_keys: int  # Kmax
    decode_mask: torch.Tensor | None  # [D, 1, 1, Kmax] additive
    extends: tuple[Extend, ...]
    # the decode rows as the C kernel reads them (kernels/native/paged_decode.py): keys in place from
    # the pages, no key grid; None when it cannot serve the step (not fp32 on CPU, kernels off). When
    # set, decode_slots / decode_mask are None unless a fixed grid width was asked for (a compiled step)
    native: paged_decode.DecodeRows | None = None
    # ``native`` holds every flat row, in order (row i is its row i): an all-decode step, or one whose
    # requests are all decodes and short multi-token requests (an MTP verify step) -- what a decoder
    # layer's one C call (llm_core/model/layers/fused_decode.py) can serve
    native_every_row: bool = False

    @staticmethod
    def build(
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        page_size: int,
        window: int | None,
        dtype: torch.dtype = torch.float32,
        keys: int | None = None,
        head_dim: int | None = None,
    ) -> AttentionPlan:
        """Plan for the batch; raises RuntimeError when a visible key's page was released (with the
        C decode kernel: a decode row's page, when the kernel reaches it in the first layer's call).

        ``keys``: width of the decode key grid (default: the widest visible span of the batch). A
        fixed width keeps the plan's shapes independent of the lengths (a compiled decode step per
        batch bucket); the extra columns are masked padding. ``head_dim``: the query/key head size
        (None: unknown, no chunk path)."""
        device = block_table.device
        # the batch's shape (which requests decode, where each starts) read once into Python ints:
        # per-request decisions on tensors would cost a dispatch and a host read each
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        num_requests, num_tokens = len(lens), qsl[-1]
        decode = [b for b in range(num_requests) if qsl[b + 1] - qsl[b] == 1]
        rows = slots = mask = None
        kmax = 0
        native = None
        short = []
        chunks = head_dim is not None and head_dim <= NATIVE_CHUNK_HEAD_DIM
        if keys is None and paged_decode.available(dtype, device):
            limit = ((NATIVE_CHUNK_ROWS if chunks else NATIVE_SHORT_ROWS) if window is None
                     else num_tokens if window <= NATIVE_ANY_ROWS_WINDOW else NATIVE_SHORT_ROWS_SLIDING)
            # a full layer's longer chunk too when its keys are few (a fresh prompt's chunk): NATIVE_CHUNK_KEYS
            keys_limit = NATIVE_CHUNK_KEYS if chunks and window is None else 0
            short = [b for b in range(num_requests)
                     if 1 < qsl[b + 1] - qsl[b] and (qsl[b + 1] - qsl[b] <= limit or lens[b] <= keys_limit)]
        if short:
            # a window under NATIVE_ANY_ROWS_WINDOW keys: a row's few dot products cost less than a block
            # of logits (376 fresh rows at W = 8: the same time either way)
            chunk_after = NATIVE_SHORT_ROWS if chunks and (window is None or window >= NATIVE_ANY_ROWS_WINDOW) else 0
            # query row i of an n-row request is a decode row whose context ends at its own position
            # (length L - n + 1 + i): the C kernel's causal and window limits per row are exactly the
            # extend mask's, and the new tokens' K/V are in the pool before attention runs
            requests, row_lens, rows_list = [], [], []
            for b in sorted(decode + short):
                n = qsl[b + 1] - qsl[b]
                requests += [b] * n
                row_lens += range(lens[b] - n + 1, lens[b] + 1)
                rows_list += range(qsl[b], qsl[b + 1])
            # (lists to tensors through numpy: torch.tensor of a 376-row chunk's lists took ~0.3 ms a plan)
            table = block_table.index_select(0, long_tensor(requests))
            native = paged_decode.DecodeRows.build(table, long_tensor(row_lens), range(len(rows_list)), rows_list,
                                                   num_tokens=num_tokens, page_size=page_size, window=window,
                                                   chunk_after=chunk_after)
            rows = native.rows  # the same values
            decode = decode + short  # none of them is an extend below
        elif decode:
            every = len(decode) == num_requests  # all rows decode: request b is row b, no selection
            rows_list = list(range(len(decode))) if every else [qsl[b] for b in decode]
            if paged_decode.available(dtype, device):
                native = paged_decode.DecodeRows.build(block_table, seq_lens, decode, rows_list, num_tokens=num_tokens,
                                                       page_size=page_size, window=window)
            if native is None or keys is not None:  # the torch path's key grid: it serves this step
                # (or a compiled one: the C call stays out of traced graphs)
                table = block_table if every else block_table[torch.tensor(decode, device=device)]
                slots, kmax, mask = decode_grid(table, [lens[b] for b in decode], page_size=page_size,
                                                 window=window, keys=keys, dtype=dtype)
            rows = (torch.arange(len(decode), device=device) if every
                    else native.rows if native is not None else long_tensor(rows_list).to(device))
        extends = []
        served = set(decode)
        for b in range(num_requests):
            start, end, seq_len = qsl[b], qsl[b + 1], lens[b]
            n = end - start
            if n <= 1 or b in served:
                continue
            first = 0 if window is None else max(0, seq_len - n - window + 1)
            pos_k = torch.arange(first, seq_len, device=device)
            pages = block_table[b][pos_k // page_size]
            _check_mapped(pages, pos_k)
            fresh = first == seq_len - n
            m = band = None
            if window is not None:
                band = SlidingBand.plan(n, seq_len - first, window, dtype, device)
            if band is None and (not fresh or (window is not None and window < n)):  # else: plain causal
                m = _extend_mask(n, seq_len - first, window, dtype, device)
            extends.append(Extend(start, end, pages * page_size + pos_k % page_size, m, fresh, band))
        all_decode = not short and len(decode) == num_tokens == num_requests
        # the rows were listed in request order, each request's rows ascending: all of them is 0 .. T-1
        every_row = native is not None and native.rows.shape[0] == num_tokens
        return AttentionPlan(num_tokens, rows, all_decode, slots, kmax, mask, tuple(extends), native, every_row)

    def picked(self, rows: torch.Tensor) -> AttentionPlan | None:
        """The plan of this step's flat ``rows`` (each the last new row of its request: the logits rows)
        as decode rows of a batch of their own -- what ``build`` makes of ``ForwardBatch.logits_batch()``
        (each row over its request's pages and whole context) -- taken from this plan's kernel rows:
        row i of an every-row plan is flat row i, and a request's last row already sees its whole
        context. No sub-batch and no second build: inside a short prefill step those cost ~0.2 ms of
        serial Python (the same-prefix request's first token 6.32 -> 6.14 ms, medians of 40
        alternating). None unless every row of this step is a kernel row (``native_every_row``)."""
        n = self.native
        if n is None or not self.native_every_row:
            return None
        requests = n.requests.index_select(0, rows.cpu())
        count = requests.shape[0]
        every = torch.arange(count)
        sub = paged_decode.DecodeRows(n.table.index_select(0, requests), n.seq_lens.index_select(0, requests), every,
                                      every, count, n.page_size, n.window)
        return AttentionPlan(count, every.to(rows.device), True, None, 0, None, (), sub, True)

    @staticmethod
    def decode_steps(block_table: torch.Tensor, seq_lens: torch.Tensor, active: torch.Tensor | None,
                     rows: list[list[int]], *, page_size: int, window: int | None,
                     dtype: torch.dtype = torch.float32) -> list[AttentionPlan]:
        """Plans of S consecutive all-decode steps over the same page table, index work done once
        (MTP draft steps): step s decodes the requests b with ``active[s, b]`` (``rows[s]``, ascending;
        ``active`` None: every request every step), each with context ``seq_lens[s, b]`` ([S, B] CPU
        tensors; rows ``b`` of ``block_table``, in order). Every step uses the widest key grid of the
        S steps; the extra columns are masked like any padding and re-read the step's own newest key,
        so the outputs are those of ``build`` per step."""
        device = block_table.device
        lens = seq_lens.to(torch.long)
        if active is not None:
            lens = torch.where(active, lens, 1)  # inactive: a harmless in-range position
        if paged_decode.available(dtype, device):  # the C kernel reads each step's keys in place: no grid
            return [AttentionPlan(len(picked), torch.arange(len(picked), device=device), True, None, 0, None, (),
                                  paged_decode.DecodeRows.build(block_table, lens[s], picked, list(range(len(picked))),
                                                                num_tokens=len(picked), page_size=page_size,
                                                                window=window), True)
                    for s, picked in enumerate(rows)]
        first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
        span = lens - first
        kmax = int(span.max())
        j = torch.arange(kmax)
        pos = torch.minimum(first[..., None] + j, (lens - 1)[..., None])  # [S, B, K]
        pages = block_table.gather(1, (pos // page_size).to(device).permute(1, 0, 2).reshape(lens.shape[1], -1))
        pages = pages.reshape(lens.shape[1], lens.shape[0], kmax).permute(1, 0, 2)  # [S, B, K]
        if active is None:
            _check_mapped(pages, pos)
        else:
            _check_mapped(pages[active.to(device)], pos[active].to(device))
        slots = pages * page_size + (pos % page_size).to(device)
        mask = torch.zeros(*lens.shape, 1, 1, kmax, dtype=dtype)
        mask.masked_fill_((j >= span[..., None])[:, :, None, None, :], float("-inf"))
        mask = mask.to(device)
        plans, aranges = [], {}
        for s, picked in enumerate(rows):
            n = len(picked)
            if n == lens.shape[1]:
                step_slots, step_mask = slots[s], mask[s]
            else:
                idx = torch.tensor(picked, device=device)
                step_slots, step_mask = slots[s][idx], mask[s][idx]
            if n not in aranges:  # steps with as many rows share one index tensor
                aranges[n] = torch.arange(n, device=device)
            plans.append(AttentionPlan(n, aranges[n], True, step_slots.reshape(-1), kmax, step_mask, ()))
        return plans


def decode_grid(table: torch.Tensor, lens: list[int], *, page_size: int, window: int | None, keys: int | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The padded key grid of decode requests with contexts ``lens`` (``table``: their block-table
    rows): flat pool slots [D * K], the width K, the additive mask [D, 1, 1, K]."""
    device = table.device
    d_lens = torch.tensor(lens, dtype=torch.long)
    first = torch.zeros_like(d_lens) if window is None else (d_lens - window).clamp(min=0)
    span = d_lens - first
    kmax = max(n - (0 if window is None else max(0, n - window)) for n in lens)
    if keys is not None:
        if keys < kmax:
            raise ValueError(f"decode key grid of {keys} keys is narrower than a visible span of {kmax}")
        kmax = keys
    j = torch.arange(kmax)
    valid = j[None, :] < span[:, None]
    pos = torch.minimum(first[:, None] + j[None, :], (d_lens - 1)[:, None]).to(device)
    pages = table.gather(1, pos // page_size)
    _check_mapped(pages, pos)
    slots = (pages * page_size + pos % page_size).reshape(-1)
    mask = torch.zeros(len(lens), 1, 1, kmax, dtype=dtype)
    mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
    return slots, kmax, mask.to(device)


def _extend_mask(n: int, keys: int, window: int | None, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, n, keys] additive mask of a request's last n positions over its last ``keys`` keys:
    query i sits at key column c_i = keys - n + i and sees columns j with c_i - window < j <= c_i,
    i.e. j - i <= keys - n (triu_ above that diagonal is -inf) and, with a window,
    j - i > keys - n - window (tril_ up to that diagonal is -inf)."""
    m = torch.full((1, 1, n, keys), float("-inf"), dtype=dtype, device=device).triu_(keys - n + 1)
    if window is not None:
        m.add_(torch.full_like(m, float("-inf")).tril_(keys - n - window))
    return m


def _check_mapped(pages: torch.Tensor, positions: torch.Tensor) -> None:
    if bool((pages < 0).any()):
        bad = positions[pages < 0][0].item()
        raise RuntimeError(f"attention reads logical position {bad} whose page was released")
