"""L2: host-memory copies of KV pages, keyed by the page's content hash, under their own byte budget.

One *row* holds one page of one kind over every layer of that kind, K then V per layer, flattened:

    Full row:  [ L0.K (ps*kvh*d) | L0.V (ps*kvh*dv) | L5.K | L5.V | ... ]      (full layers only)
    SWA row:   [ L1.K | L1.V | L2.K | L2.V | ... ]                             (sliding layers only)

An entry = one Full row + optionally one SWA row (SWA KV exists only where the tree kept it). Rows live
in two preallocated host tensors (page-locked at their exact size when the device pool is on CUDA,
so copies can be async: pinned_host.py).
Eviction is LRU over entries; when only SWA rows run short, the LRU entries lose just their SWA row.
Copies between L1 and rows, and a page's bytes in L3, are in page_format.py.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from llm_core.kvcache.dual_pool import KVLayout
from llm_core.kvcache.tiers.pinned_host import PinnedHostBuffer


@dataclass
class HostEntry:
    full_row: int
    swa_row: int = -1  # -1: no SWA KV for this page on the host


def row_elements(layout: KVLayout, kind: str, page_size: int) -> int:
    """Elements of one row of ``kind`` ("full" or "sliding")."""
    spec = layout.full if kind == "full" else layout.sliding
    layers = layout.full_layers if kind == "full" else layout.swa_layers
    return len(layers) * page_size * spec.elements_per_token()


class HostKVPool:
    """Invariant (``check_integrity``): every row is either free or used by exactly one entry."""

    def __init__(self, layout: KVLayout, page_size: int, dtype: torch.dtype, budget_bytes: int, *,
                 swa_fraction: float = 0.5, pin_for: torch.device | None = None) -> None:
        """``pin_for``: the CUDA device the rows are copied to and from (page-locked for it), or None."""
        if budget_bytes <= 0:
            raise ValueError(f"host KV budget must be > 0 bytes, got {budget_bytes}")
        if not 0.0 <= swa_fraction < 1.0:
            raise ValueError(f"swa_fraction must be in [0, 1), got {swa_fraction}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.full_elems = row_elements(layout, "full", page_size)
        self.swa_elems = row_elements(layout, "sliding", page_size)
        swa_budget = int(budget_bytes * swa_fraction) if self.swa_elems else 0
        n_full = (budget_bytes - swa_budget) // max(1, self.full_elems * itemsize)
        n_swa = swa_budget // (self.swa_elems * itemsize) if self.swa_elems else 0
        if n_full < 1:
            raise ValueError(f"host KV budget of {budget_bytes} bytes holds no page "
                             f"({self.full_elems * itemsize} bytes per Full row)")
        # page-locked at their exact sizes (pinned_host.py: torch's pin_memory would round each up
        # to a power of two); the buffers own the registrations, so the pool holds them
        self._buffers = (PinnedHostBuffer(n_full, self.full_elems, dtype, pin_for=pin_for),
                         PinnedHostBuffer(n_swa, max(1, self.swa_elems), dtype, pin_for=pin_for))
        self.full_data, self.swa_data = (b.tensor for b in self._buffers)
        self._free_full = list(range(n_full - 1, -1, -1))
        self._free_swa = list(range(n_swa - 1, -1, -1))
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self.evictions = 0

    # ---- public API ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_data, self.swa_data))

    @property
    def num_full_rows(self) -> int:
        return self.full_data.shape[0]

    @property
    def num_swa_rows(self) -> int:
        return self.swa_data.shape[0]

    def get(self, key: bytes) -> HostEntry | None:
        """The entry for ``key`` (now most recently used), or None."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: bytes, full: torch.Tensor | None, swa: torch.Tensor | None) -> HostEntry | None:
        """Store a page (``full`` [full_elems] required for a new entry; ``swa`` adds or replaces the
        SWA row). Evicts LRU entries for room; None when nothing could be stored."""
        entry = self.entries.get(key)
        if entry is None:
            if full is None:
                return None
            row = self._take(self._free_full, key, swa=False)
            if row is None:
                return None
            entry = self.entries[key] = HostEntry(row)
            self.full_data[row].copy_(full.reshape(-1), non_blocking=True)
        self.entries.move_to_end(key)
        if swa is not None and self.swa_elems:
            if entry.swa_row < 0:
                row = self._take(self._free_swa, key, swa=True)
                if row is None:
                    return entry
                entry.swa_row = row
            self.swa_data[entry.swa_row].copy_(swa.reshape(-1), non_blocking=True)
        return entry

    def drop(self, key: bytes) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._free_full.append(entry.full_row)
            if entry.swa_row >= 0:
                self._free_swa.append(entry.swa_row)

    def check_integrity(self) -> None:
        full = [e.full_row for e in self.entries.values()] + self._free_full
        swa = [e.swa_row for e in self.entries.values() if e.swa_row >= 0] + self._free_swa
        assert sorted(full) == list(range(self.num_full_rows)), "Full rows lost or shared"
        assert sorted(swa) == list(range(self.num_swa_rows)), "SWA rows lost or shared"

    # ---- internal helpers ---------------------------------------------------------------------
    def _take(self, free: list[int], keep: bytes, *, swa: bool) -> int | None:
        """A free row, evicting LRU entries (never ``keep``) until one is free."""
        while not free:
            victim = next((k for k, e in self.entries.items() if k != keep and (not swa or e.swa_row >= 0)), None)
            if victim is None:
                return None
            if swa:  # only the SWA row is short: the entry keeps its Full row
                entry = self.entries[victim]
                free.append(entry.swa_row)
                entry.swa_row = -1
            else:
                self.drop(victim)
            self.evictions += 1
        return free.pop()
