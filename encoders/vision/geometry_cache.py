"""Per grid list, the pixel-independent half of a vision forward, built once and reused.

A packed batch's index tensors (``cu_seqlens``, unit permutations, patch coordinates) and the 2-D
RoPE tables depend only on the items' grids, never on pixel values. A video's frame groups all
share one grid, and the encoder worker runs them one group per forward, so without a cache every
forward rebuilt the same tensors (~0.3 ms of a ~6 ms forward on the demo model's 6x12 groups,
benchmarks/frame_group.py):

    grids ((1, 10, 18),)  --miss--> VisionPackedBatch.build (empty rows) + cos/sin, row and column order
                          --hit---> the same tensors; only the rows are new

Entries are read-only once stored (forwards never write into them). The cache is bounded by the
bytes its tensors hold, least recently used first out, so a stream of odd image sizes cannot grow it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from encoders.rotary import vision_rotary
from encoders.vision.packing import VisionPackedBatch, validate_grid

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, signed sin) [N, head_dim]


@dataclass(frozen=True)
class PackedGeometry:
    """A row-less packed batch of some grids plus its RoPE tables in row and column unit order."""

    template: VisionPackedBatch  # rows: an empty [N, 0] placeholder
    rope_row: Rope
    rope_col: Rope

    def batch(self, rows: torch.Tensor) -> VisionPackedBatch:
        if rows.dim() != 2 or rows.shape[0] != self.template.num_tokens:
            raise ValueError(f"grid_thw {list(self.template.grids)} describe {self.template.num_tokens} patches "
                             f"but rows of shape {tuple(rows.shape)} were given")
        return dataclasses.replace(self.template, rows=rows)

    def rope(self, order: str) -> Rope:
        return self.rope_col if order == "col" else self.rope_row

    @property
    def nbytes(self) -> int:
        t = self.template
        tensors = (t.cu_seqlens, t.coords, t.col_index, t.row_index, *self.rope_row, *self.rope_col)
        return sum(x.numel() * x.element_size() for x in tensors)


def build_geometry(grids: Sequence[Sequence[int]], merge: int, head_dim: int, theta: float,
                   device: torch.device) -> PackedGeometry:
    """The uncached construction (what every forward did before the cache)."""
    grids = tuple(validate_grid(g, merge) for g in grids)
    n = sum(t * h * w for t, h, w in grids)
    template = VisionPackedBatch.build(torch.empty(n, 0, device=device), grids, merge)
    cos, sin = vision_rotary(template.coords, head_dim, theta)
    index = template.col_index
    return PackedGeometry(template, (cos, sin), (template.permute_units(cos, index), template.permute_units(sin, index)))


class GeometryCache:
    """LRU of :class:`PackedGeometry` keyed by (grids, device), bounded by ``max_bytes``."""

    def __init__(self, merge: int, head_dim: int, theta: float, max_bytes: int = 32 << 20) -> None:
        if max_bytes < 0:
            raise ValueError(f"GeometryCache max_bytes must be >= 0, got {max_bytes}")
        self.merge, self.head_dim, self.theta, self.max_bytes = merge, head_dim, theta, max_bytes
        self.hits = self.misses = 0
        self._bytes = 0
        self._entries: OrderedDict[tuple, PackedGeometry] = OrderedDict()
        self._lock = threading.Lock()  # the encoder worker and a direct caller may share a tower

    def get(self, grids: Sequence[Sequence[int]], device: torch.device) -> PackedGeometry:
        key = (tuple(tuple(int(x) for x in g) for g in grids), str(device))
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        geometry = build_geometry(key[0], self.merge, self.head_dim, self.theta, torch.device(device))
        size = geometry.nbytes
        if size > self.max_bytes:
            return geometry  # too large to keep: one huge image would evict every video grid
        with self._lock:
            if key not in self._entries:
                self._entries[key] = geometry
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.nbytes
        return geometry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(g.nbytes for g in self._entries.values())
            if total != self._bytes or self._bytes > self.max_bytes:
                raise AssertionError(f"geometry cache holds {total} bytes, counted {self._bytes} "
                                     f"(limit {self.max_bytes})")
