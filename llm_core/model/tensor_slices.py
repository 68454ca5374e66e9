"""Read part of a checkpoint tensor -- some rows, a column range -- without reading the rest, FP8
blocks included. This is how a tensor-parallel rank loads only its share of each weight.

    rows  an ordered index list (e.g. one rank's q, k and v head rows of a fused qkv, through the
          disk-order permutation); it is read as runs of consecutive rows
    cols  [c0, c1)

FP8 weights carry one scale per (bn x bk) block, so a run is widened to whole blocks, dequantised with
its own scale rows and columns, and cut back (a shard boundary need not fall on a block edge):

    rows of one quantisation chunk c (the fused qkv has C chunks, each with its own block rows):
      chunk start ─┬──────── block br0 ────────┬── ... ──┬──── block br1-1 ───┐
                   │        [ a ............................... b )          │ <- wanted run
                   └── read rows [br0*bn, min(br1*bn, chunk)) + scale rows [br0, br1) ─┘
"""

from __future__ import annotations

import torch

from llm_core.model.fp8 import FP8_DTYPE, dequantize_blockwise


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive ascending indices, in order: [4,5,6,0,1] -> [(4,7), (0,2)]."""
    idx = rows.tolist()
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def read_slice(handle, name: str, rows: torch.Tensor | None, cols: tuple[int, int] | None,
               scale_handle=None, block: tuple[int, int] | None = None, quant_chunks: int = 1) -> torch.Tensor:
    """Rows ``rows`` (all when None) and columns ``cols`` of tensor ``name`` from a safetensors handle,
    dequantised to fp32 when ``scale_handle`` holds its ``weight_scale_inv``."""
    sl = handle.get_slice(name)
    shape = list(sl.get_shape())
    n = shape[0]
    row_runs = [(0, n)] if rows is None else runs(rows)
    if scale_handle is None:
        if len(shape) == 1:
            return torch.cat([sl[a:b] for a, b in row_runs])
        c0, c1 = cols if cols is not None else (0, shape[1])
        parts = [sl[a:b, c0:c1] for a, b in row_runs]
        t = torch.cat(parts)
        if t.dtype == FP8_DTYPE:
            raise ValueError(f"{name} is FP8 but the checkpoint has no {name}_scale_inv")
        return t
    return _read_fp8(sl, scale_handle.get_slice(name + "_scale_inv"), name, row_runs, cols, block, quant_chunks)


def _read_fp8(sl, ssl, name, row_runs, cols, block, chunks) -> torch.Tensor:
    n, k = sl.get_shape()
    srows_total, scols = ssl.get_shape()
    bn, bk = block
    if scols != _cdiv(k, bk):
        raise ValueError(f"{name}: weight_scale_inv shape {(srows_total, scols)}, expected {_cdiv(k, bk)} "
                         f"columns for {k} columns in {bk}-column blocks")
    chunked = chunks * _cdiv(n // chunks, bn) if n % chunks == 0 else -1
    if chunks > 1 and srows_total == chunked:
        per, srows = n // chunks, chunked // chunks
    elif srows_total == _cdiv(n, bn):
        per, srows = n, srows_total  # one global packing
    else:
        raise ValueError(f"{name}: weight_scale_inv shape {(srows_total, scols)}, expected {chunked} rows "
                         f"({chunks} row chunks) or {_cdiv(n, bn)} (global) for {n} rows in {bn}-row blocks")
    c0, c1 = cols if cols is not None else (0, k)
    bc0, bc1 = c0 // bk, _cdiv(c1, bk)
    kc0, kc1 = bc0 * bk, min(bc1 * bk, k)
    parts = []
    for a, b in row_runs:
        for c in range(a // per, _cdiv(b, per)):
            base = c * per
            ra, rb = max(a, base) - base, min(b, base + per) - base
            br0, br1 = ra // bn, _cdiv(rb, bn)
            w = sl[base + br0 * bn: base + min(br1 * bn, per), kc0:kc1]
            s = ssl[c * srows + br0: c * srows + br1, bc0:bc1]
            deq = dequantize_blockwise(w, s, block, name=name)
            parts.append(deq[ra - br0 * bn: rb - br0 * bn, c0 - kc0: c1 - kc0])
    return torch.cat(parts)


def read_fp8_blocks(handle, name: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None,
                    scale_handle, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows [r0, r1) and columns [c0, c1) of an FP8 weight *as stored*: (fp8 values, their
    weight_scale_inv rows and columns), for a weight kept in FP8 (no dequantisation). None when the
    range does not start on a block edge (or ends inside a block short of the tensor's end): its
    blocks' factors would then cover rows or columns of the neighbouring slice."""
    sl, ssl = handle.get_slice(name), scale_handle.get_slice(name + "_scale_inv")
    n, k = sl.get_shape()
    bn, bk = block
    if tuple(ssl.get_shape()) != (_cdiv(n, bn), _cdiv(k, bk)):
        raise ValueError(f"{name}: weight_scale_inv shape {tuple(ssl.get_shape())}, expected "
                         f"{(_cdiv(n, bn), _cdiv(k, bk))} for {block} blocks")
    (r0, r1), (c0, c1) = rows or (0, n), cols or (0, k)
    for lo, hi, size, b in ((r0, r1, n, bn), (c0, c1, k, bk)):
        if lo % b or (hi % b and hi != size):
            return None
    return sl[r0:r1, c0:c1], ssl[r0 // bn:_cdiv(r1, bn), c0 // bk:_cdiv(c1, bk)]
