"""Packed variable-length batches for the vision tower.

Many images / video frame groups run as ONE token sequence. Each item contributes
``t * gh * gw`` patch rows (frames outermost, merge units row-major, 4 tokens per unit for merge 2);
attention is cut per temporal slice, so ``cu_seqlens`` has one segment per frame:

    item A (t=1, 4x4)       item B (t=2, 2x4)
    [ A.f0: 16 tokens ]     [ B.f0: 8 ][ B.f1: 8 ]
    cu_seqlens = [0, 16, 24, 32]

Column order (``vit_window_attn_types`` 1) re-enumerates the *merge units* of each frame column-major;
the tokens inside a unit stay together. For a frame of 2x3 units (lh=2, lw=3):

    row order units      column order position p <- row unit col_index[p]
      0 1 2              col_index = [0, 3, 1, 4, 2, 5]
      3 4 5

The permutation never leaves a frame, so cu_seqlens hold in both orders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from encoders.rotary import vision_patch_coordinates

Grid = tuple[int, int, int]


def validate_grid(grid: Sequence[int], merge: int) -> Grid:
    """Check one (t, h, w) grid in patches; the merge size must divide h and w."""
    if len(grid) != 3:
        raise ValueError(f"grid_thw entries must be (t, h, w), got {tuple(grid)}")
    t, h, w = (int(x) for x in grid)
    if t <= 0 or h <= 0 or w <= 0:
        raise ValueError(f"grid_thw entries must be positive, got {(t, h, w)}")
    if h % merge or w % merge:
        raise ValueError(f"spatial_merge_size {merge} does not divide the patch grid {h}x{w} (grid_thw {(t, h, w)})")
    return t, h, w


def column_unit_index(grid: Grid, merge: int) -> torch.Tensor:
    """Row-order unit index for every column-order position of one item (all its frames)."""
    t, h, w = grid
    lh, lw = h // merge, w // merge
    return torch.arange(t * lh * lw).view(t, lh, lw).transpose(1, 2).reshape(-1)


@dataclass(frozen=True)
class VisionPackedBatch:
    """Patch rows of several items plus everything the tower needs to run them as one sequence."""

    rows: torch.Tensor  # [N, patch_dim]
    grids: tuple[Grid, ...]
    cu_seqlens: torch.Tensor  # [num_frames + 1] int64
    coords: torch.Tensor  # [N, 2] (h, w) patch coordinates, row order
    col_index: torch.Tensor  # [N / unit] unit gather index: row order -> column order
    row_index: torch.Tensor  # [N / unit] inverse: column order -> row order
    units_per_item: tuple[int, ...]
    merge: int

    @classmethod
    def build(cls, rows: torch.Tensor, grids: Sequence[Sequence[int]], merge: int) -> "VisionPackedBatch":
        """Pack concatenated patch rows of items with the given grids (item order = grid order)."""
        if rows.dim() != 2:
            raise ValueError(f"patch rows must be [N, patch_dim], got shape {tuple(rows.shape)}")
        grids = tuple(validate_grid(g, merge) for g in grids)
        if not grids:
            raise ValueError("a vision batch needs at least one item")
        tokens = [t * h * w for t, h, w in grids]
        if sum(tokens) != rows.shape[0]:
            raise ValueError(f"grid_thw {list(grids)} describe {sum(tokens)} patches but {rows.shape[0]} rows were given")
        unit = merge * merge
        frame_lens = [h * w for t, h, w in grids for _ in range(t)]
        cu = torch.tensor([0] + frame_lens, dtype=torch.int64).cumsum(0)
        col_parts, offset = [], 0
        for g, n in zip(grids, tokens):
            col_parts.append(column_unit_index(g, merge) + offset)
            offset += n // unit
        col_index = torch.cat(col_parts)
        device = rows.device
        return cls(
            rows=rows,
            grids=grids,
            cu_seqlens=cu.to(device),
            coords=torch.cat([vision_patch_coordinates(g, merge) for g in grids]).to(device),
            col_index=col_index.to(device),
            row_index=torch.argsort(col_index).to(device),
            units_per_item=tuple(n // unit for n in tokens),
            merge=merge,
        )

    @classmethod
    def from_items(cls, items: Sequence[tuple[torch.Tensor, Sequence[int]]], merge: int) -> "VisionPackedBatch":
        """Pack a list of (rows, grid_thw) items."""
        if not items:
            raise ValueError("a vision batch needs at least one item")
        return cls.build(torch.cat([r for r, _ in items]), [g for _, g in items], merge)

    @property
    def num_tokens(self) -> int:
        return int(self.rows.shape[0])

    def permute_units(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Reorder whole merge units of a token-major tensor ``x`` [N, ...] by a unit ``index``."""
        unit = self.merge * self.merge
        return x.reshape(-1, unit, *x.shape[1:]).index_select(0, index).reshape(x.shape)

    def split(self, merged: torch.Tensor) -> list[torch.Tensor]:
        """Per-item views of the merger output [total units, out_hidden]."""
        return list(torch.split(merged, list(self.units_per_item)))
