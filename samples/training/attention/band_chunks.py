"""Cutting a sequence into query chunks and the key spans that can reach them (band attention).

A layer that attends within ``before`` rows behind and ``after`` rows ahead of each query only
needs, for the queries ``[c * chunk, (c + 1) * chunk)``, the keys ``[c * chunk - before,
(c + 1) * chunk + after)``. Both helpers pad with zeros (False for masks) where a chunk or span
runs off either end, so every chunk has the same shape and one SDPA call covers them all:

    sequence dim  | chunk 0 | chunk 1 | chunk 2 |...
    key span 1      [before | chunk 1 | after]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pad_dim(x: torch.Tensor, dim: int, left: int, right: int) -> torch.Tensor:
    spec = [0, 0] * (x.dim() - 1 - dim) + [left, right]
    return F.pad(x, spec)


def chunk_rows(x: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """``x`` with ``dim`` (length L) padded to a multiple of ``chunk`` and split in two:
    [..., L, ...] -> [..., ceil(L / chunk), chunk, ...]."""
    n_chunks = -(-x.shape[dim] // chunk)
    x = _pad_dim(x, dim, 0, n_chunks * chunk - x.shape[dim])
    return x.unflatten(dim, (n_chunks, chunk))


def span_rows(x: torch.Tensor, dim: int, chunk: int, before: int, after: int) -> torch.Tensor:
    """The rows each chunk's queries may reach: [..., L, ...] -> [..., C, before + chunk + after, ...],
    span ``c`` holding rows ``c * chunk - before`` .. ``(c + 1) * chunk + after - 1``."""
    n_chunks = -(-x.shape[dim] // chunk)
    span = before + chunk + after
    x = _pad_dim(x, dim, before, n_chunks * chunk - x.shape[dim] + after)
    return x.unfold(dim, span, chunk).movedim(-1, dim + 1)
