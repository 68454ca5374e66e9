"""Block-wise FP8 (e4m3fn) weights as MiMo-V2 checkpoints store them.

A weight W [N, K] is stored as fp8 values and ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] fp32, one
factor per (bn x bk) block, *multiplied* back:  W ~= fp8 * scale_inv.

    cols:  0 ...... bk ...... 2bk ... K            scale_inv[r, c] covers rows [r*bn, (r+1)*bn)
    rows   +--------+--------+---+                                  cols [c*bk, (c+1)*bk)
      0    | s[0,0] | s[0,1] |   |                 (last row/col block may be partial)
      bn   | s[1,0] | s[1,1] |   |
    N      +--------+--------+---+

Fused qkv weights were quantised in C independent row chunks (docs/model.md §2.1): each chunk of N/C
rows has its own ceil(N/C/bn) scale rows, so the scale has C*ceil(N/C/bn) rows (108 on the real
full-attention layers instead of ceil(13568/128) = 106).
"""

from __future__ import annotations

import torch

from kernels.block_fp8 import FP8_DTYPE, BlockFP8, dequantize_blocks  # noqa: F401  (FP8_DTYPE: the loader's name for it)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (fp8 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]) with amax/448 block scales."""
    if w.dim() != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D weight, got shape {tuple(w.shape)}")
    q = BlockFP8.quantize(w, block)
    return q.values, q.scale_inv


def dequantize_blockwise(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, name: str = "weight"
) -> torch.Tensor:
    """fp8 [N, K] * per-block scale_inv -> fp32 [N, K]; a scale of the wrong shape names ``name``."""
    bn, bk = block
    n, k = w.shape
    expected = (_cdiv(n, bn), _cdiv(k, bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name}: weight_scale_inv shape {tuple(scale_inv.shape)}, expected {expected} for {block} blocks"
        )
    return dequantize_blocks(w, scale_inv, block)


def dequantize_row_chunks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], chunks: int, *, name: str = "weight"
) -> torch.Tensor:
    """Dequantise a weight whose rows were quantised in ``chunks`` equal independent parts.

    Falls back to global block packing when the scale has exactly ceil(N/bn) rows and the chunked
    count differs (vLLM's reading of "globally packed" scales).
    """
    n, _ = w.shape
    bn = block[0]
    chunked_rows = chunks * _cdiv(n // chunks, bn) if n % chunks == 0 else -1
    if scale_inv.shape[0] == chunked_rows:
        per = n // chunks
        srows = chunked_rows // chunks
        parts = [
            dequantize_blockwise(w[c * per : (c + 1) * per], scale_inv[c * srows : (c + 1) * srows], block, name=name)
            for c in range(chunks)
        ]
        return torch.cat(parts)
    if scale_inv.shape[0] == _cdiv(n, bn):
        return dequantize_blockwise(w, scale_inv, block, name=name)
    raise ValueError(
        f"{name}: weight_scale_inv has {scale_inv.shape[0]} rows; expected {chunked_rows} ({chunks} row chunks) "
        f"or {_cdiv(n, bn)} (global) for {n} rows in {bn}-row blocks"
    )


def quantize_row_chunks(w: torch.Tensor, block: tuple[int, int], chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``chunks`` equal row parts independently; scales concatenated (the hub fused-qkv way)."""
    if w.shape[0] % chunks:
        raise ValueError(f"{w.shape[0]} rows do not split into {chunks} chunks")
    per = w.shape[0] // chunks
    parts = [quantize_blockwise(w[c * per : (c + 1) * per], block) for c in range(chunks)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
