"""The MiMo-V2.5 vision tower (``visual.*`` in the checkpoint): patch embed -> blocks -> merger.

Input: patch rows of many images / frame groups packed into one sequence plus their grid_thw
(see :mod:`encoders.vision.packing`); output: one ``out_hidden_size`` embedding per merge unit, per item.

Unit order across blocks follows ``config.block_kinds`` (data, not index arithmetic). Full blocks are
order-agnostic (no band), so the tower only permutes when the order a block *needs* changes:

    kinds:   full row row row row col col col col full row ...
    order:   row  row row row row col col col col row  row ...   (full blocks run in row order)
                                  ^ to col        ^ back to row
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from encoders.config import VisionConfig
from encoders.vision.blocks import VisionBlock
from encoders.vision.geometry_cache import GeometryCache
from encoders.vision.merger import PatchMerger
from encoders.vision.packing import VisionPackedBatch


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride == (temporal, patch, patch) and no bias, run as one matmul over
    rows of C*temporal*patch*patch (the row's element order is the weight's flatten order)."""

    def __init__(self, config: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.hidden_size = config.hidden_size
        self.patch_dim = config.patch_dim
        self.proj = nn.Conv3d(config.in_chans, config.hidden_size, kernel_size=kernel, stride=kernel, bias=False,
                              device=device, dtype=dtype)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[-1] != self.patch_dim:
            raise ValueError(f"patch rows have {rows.shape[-1]} values, the patch embed expects {self.patch_dim}")
        weight = self.proj.weight.view(self.hidden_size, self.patch_dim)
        return torch.nn.functional.linear(rows.to(weight.dtype), weight)


class VisionTransformer(nn.Module):
    """The tower. Build with ``VisionTransformer(config)``; load weights with :mod:`encoders.weights`."""

    def __init__(self, config: VisionConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(
            VisionBlock(config, with_sinks=config.has_sinks(b), device=device, dtype=dtype)
            for b in range(config.depth)
        )
        self.merger = PatchMerger(config, device=device, dtype=dtype)
        self.geometry = GeometryCache(config.spatial_merge_size, config.head_dim, config.rope_theta)

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def pack(self, rows: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> VisionPackedBatch:
        """Pack concatenated patch rows (moved to the tower's device) with their grids; the index
        tensors come from the geometry cache (a video's groups share one grid)."""
        return self.geometry.get(grid_thw, self.device).batch(rows.to(self.device))

    @torch.no_grad()
    def forward(self, rows: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Encode concatenated patch rows of items -> per-item [t*h*w/unit, out_hidden]."""
        batch = self.pack(rows, grid_thw)
        return batch.split(self.forward_packed(batch))

    @torch.no_grad()
    def encode_items(self, items: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> list[torch.Tensor]:
        """Encode a list of (rows, grid_thw) items in one packed forward."""
        if not items:
            return []
        rows = [r.to(self.device) for r, _ in items]
        return self.forward(rows[0] if len(rows) == 1 else torch.cat(rows), [g for _, g in items])

    @torch.no_grad()
    def forward_packed(self, batch: VisionPackedBatch) -> torch.Tensor:
        """Run a packed batch -> [total units, out_hidden] in item order (row-major units)."""
        cfg = self.config
        x = self.patch_embed(batch.rows)
        geometry = self.geometry.get(batch.grids, batch.rows.device)
        order = "row"
        for block, kind in zip(self.blocks, cfg.block_kinds):
            need = "col" if kind == "col" else "row"
            if need != order:
                x = batch.permute_units(x, batch.col_index if need == "col" else batch.row_index)
                order = need
            cos, sin = geometry.rope(order)
            window = None if kind == "full" else cfg.window
            x = block(x, cos, sin, batch.cu_seqlens, window)
        if order != "row":
            x = batch.permute_units(x, batch.row_index)
        return self.merger(x)
