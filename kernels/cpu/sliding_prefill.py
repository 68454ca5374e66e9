"""Sliding-window attention of a long prefill chunk as query blocks, each over its own band of keys.

A chunk of n queries of a sliding layer (window W, the query included) sees at most W keys per query,
but one flash call over all of its n + W - 1 keys with a band mask computes n x (n + W - 1) logits
(the CPU flash kernel does not skip masked blocks): for a 376-token prompt and W = 8 that is ~45x the
useful work. Here the queries are cut into blocks of B rows and block b sees only the B + W - 1 keys
its rows can reach, all blocks in one batched flash call:

    keys as gathered for the chunk (K = n + min(W - 1, context before the chunk)), front-padded by
    P = W - 1 - (K - n) zero rows so that query i sees padded key columns i .. i + W - 1:

        padded keys   |P P k k k k k k k k k k k k k k . .|      (W = 3, B = 4, n = 12, P = 2)
        block 0 rows 0..3   sees columns  0 ..  5             mask: band, and columns < P off
        block 1 rows 4..7   sees columns  4 ..  9             mask: band
        block 2 rows 8..11  sees columns  8 .. 13             mask: band

    a block's key view is a strided window of the padded keys (unfold, step B): no gather. Rows past
    n (the last block's padding) see zero keys and are dropped.

The band mask is the same for every block (query r of a block sees its columns r .. r + W - 1); the
first block(s) also hide the P front-pad columns. A plan is built once per step and pool (the chunk's
shape), like the rest of ``AttentionPlan``. Results equal the one-call path to fp32 rounding (the
same logits; the flash kernel's tiles, so its summation order, differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

# Query rows per block. Smaller blocks compute fewer masked logits (B + W - 1 keys per row, W of
# them used) but give the flash kernel smaller tiles. One layer, one thread, fp32, CPU ms per call
# with the one-call path first, then blocks of 16 / 32 / 64 / 128 rows: 376 rows, W = 8, 8 heads of
# 24: 2.61 -> 0.94 / 0.87 / 1.11 / 1.36; the same at W = 128: 2.34 -> 4.65 / 1.65 / 1.79 / 2.13;
# 2048 rows, W = 128, 64 heads of 192 (MiMo-V2.5's sliding layers): 2649 -> 548 / 506 / 614 / 613.
BLOCK = 32


@dataclass(frozen=True)
class SlidingBand:
    """How one chunk of ``n`` queries splits into ``blocks`` blocks of ``block`` rows over a window."""

    n: int
    window: int
    block: int
    blocks: int
    front_pad: int  # P: zero key rows in front of the gathered keys
    mask: torch.Tensor  # [blocks or 1, 1, block, block + window - 1] additive

    @staticmethod
    def plan(n: int, keys: int, window: int, dtype: torch.dtype, device) -> "SlidingBand | None":
        """The band of a chunk of ``n`` queries over its last ``keys`` keys (the chunk's own n and up
        to W - 1 before it), or None when one call over all keys is no more work (short chunks)."""
        block = BLOCK
        if n <= block or not n <= keys <= n + window - 1:
            return None
        blocks = -(-n // block)
        span = block + window - 1
        r = torch.arange(block)[:, None]
        j = torch.arange(span)[None, :]
        hidden = (j < r) | (j > r + window - 1)  # [block, span]: the band, the same in every block
        front_pad = window - 1 - (keys - n)
        if front_pad:  # the pad columns (global column b * block + j < P) of the first blocks too
            b = torch.arange(blocks)[:, None, None]
            hidden = hidden | (b * block + j < front_pad)  # [blocks, block, span]
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
        return SlidingBand(n, window, block, blocks, front_pad, mask.view(-1, 1, block, span).to(device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend) -> torch.Tensor:
        """q [n, Hq, d], k [K, Hkv, d], v [K, Hkv, dv] (the chunk's keys, oldest first) -> [n, Hq, dv].
        ``attend(q, k, v, mask)`` is the caller's batched kernel call (q [B, Q, Hq, d], ...)."""
        rows = self.blocks * self.block
        span = self.block + self.window - 1
        tail = rows + self.window - 1 - self.front_pad - k.shape[0]
        # zero rows before (P) and after (to a whole number of blocks) on the row axis (the last pad
        # pair of F.pad is the first dim here: (d, d, heads, heads, rows_before, rows_after))
        kp = F.pad(k, (0, 0, 0, 0, self.front_pad, tail))
        vp = F.pad(v, (0, 0, 0, 0, self.front_pad, tail))
        kb = kp.unfold(0, span, self.block).permute(0, 3, 1, 2)  # [blocks, span, Hkv, d], a view
        vb = vp.unfold(0, span, self.block).permute(0, 3, 1, 2)
        qb = F.pad(q, (0, 0, 0, 0, 0, rows - self.n)).view(self.blocks, self.block, q.shape[1], q.shape[2])
        out = attend(qb, kb, vb, self.mask)  # [blocks, block, Hq, dv]
        return out.reshape(rows, out.shape[2], out.shape[3])[: self.n]
