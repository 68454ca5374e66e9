"""L2: host-memory copies of KV pages, keyed by the page's content hash, under their own byte budget.

One *row* holds one page of one kind over every layer of that kind, K then V per layer, flattened:

    Full row:  [ L0.K (ps*kvh*d) | L0.V (ps*kvh*dv) | L5.K | L5.V | ... ]      (full layers only)
    SWA row:   [ L1.K | L1.V | L2.K | L2.V | ... ]                             (sliding layers only)

An entry = one Full row + optionally one SWA row (SWA KV exists only where the tree kept it). Rows live
in two preallocated host tensors (pinned when the device pool is on CUDA, so copies can be async).
Eviction is LRU over entries; when only SWA rows run short, the LRU entries lose just their SWA row.
"""

from __future__ import annotations

import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import blake3
import torch

from kernels import ops
from llm_core.kvcache.dual_pool import DualKVPool, KVLayout


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
                 swa_fraction: float = 0.5, pin: bool = False) -> None:
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
        pin = pin and torch.cuda.is_available()
        self.full_data = torch.zeros(n_full, self.full_elems, dtype=dtype, pin_memory=pin)
        self.swa_data = torch.zeros(n_swa, max(1, self.swa_elems), dtype=dtype, pin_memory=pin)
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


# ---- L1 <-> rows ----------------------------------------------------------------------------------
def _slots(pages: list[int], page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of whole pages (page -1 -> slot 0, marked invalid) and the per-slot validity mask."""
    t = torch.tensor(pages, dtype=torch.long)
    valid = (t >= 0).repeat_interleave(page_size)
    slots = (t.clamp(min=0)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return slots.to(device), valid.to(device)


def gather_pages(pool: DualKVPool, kind: str, pages: list[int]) -> torch.Tensor:
    """Rows [len(pages), row_elements] (CPU) of L1 pages of ``kind``; pages < 0 come back as zeros and
    are never read (the kernels' validity mask)."""
    layers = pool.layout.full_layers if kind == "full" else pool.layout.swa_layers
    k0, _ = pool.layer(layers[0])
    slots, valid = _slots(pages, pool.page_size, k0.device)
    parts = []
    for i in layers:
        for cache in pool.layer(i):
            parts.append(ops.gather_slots(cache, slots, valid).reshape(len(pages), -1))
    return torch.cat(parts, dim=1).cpu()


def scatter_layer(pool: DualKVPool, layer: int, pages: list[int], rows: torch.Tensor) -> None:
    """Write layer ``layer``'s part of ``rows`` (rows of the layer's kind) into L1 ``pages``.

    Row layout (see the module docstring): the j-th layer of a kind starts at j * per_layer,
    K first (ps*kvh*d), then V (ps*kvh*dv).
    """
    kind = pool.layout.layer_kinds[layer]
    layers = pool.layout.full_layers if kind == "full" else pool.layout.swa_layers
    spec = pool.layout.full if kind == "full" else pool.layout.sliding
    ps, n = pool.page_size, len(pages)
    k_cache, v_cache = pool.layer(layer)
    k_len = ps * spec.num_kv_heads * spec.head_dim
    start = layers.index(layer) * ps * spec.elements_per_token()
    rows = rows.to(k_cache.device, non_blocking=True)
    slots, valid = _slots(pages, ps, k_cache.device)
    k = rows[:, start:start + k_len].reshape(n * ps, spec.num_kv_heads, spec.head_dim)
    v = rows[:, start + k_len:start + ps * spec.elements_per_token()]
    ops.scatter_slots(k_cache, slots, k, valid)
    ops.scatter_slots(v_cache, slots, v.reshape(n * ps, spec.num_kv_heads, spec.v_head_dim), valid)


# ---- L3 value format and keys -------------------------------------------------------------------
_VALUE = struct.Struct("<4sBBII")  # magic, has_swa, itemsize, full_elems, swa_elems
_MAGIC = b"KVP1"


def encode_page(full: torch.Tensor, swa: torch.Tensor | None) -> bytes:
    """One page for the store: header + Full row bytes (+ SWA row bytes)."""
    head = _VALUE.pack(_MAGIC, swa is not None, full.element_size(), full.numel(),
                       0 if swa is None else swa.numel())
    body = full.contiguous().view(torch.uint8).numpy().tobytes()
    if swa is not None:
        body += swa.contiguous().view(torch.uint8).numpy().tobytes()
    return head + body


def decode_page(raw: bytes, dtype: torch.dtype, full_elems: int, swa_elems: int
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(Full row, SWA row or None) from ``encode_page`` bytes; None when the value does not fit this
    model's geometry (another layout, dtype or a damaged value that passed the store's checksum)."""
    if len(raw) < _VALUE.size:
        return None
    magic, has_swa, itemsize, n_full, n_swa = _VALUE.unpack_from(raw)
    want_item = torch.empty((), dtype=dtype).element_size()
    if magic != _MAGIC or itemsize != want_item or n_full != full_elems or (has_swa and n_swa != swa_elems):
        return None
    if len(raw) != _VALUE.size + (n_full + (n_swa if has_swa else 0)) * itemsize:
        return None
    data = torch.frombuffer(bytearray(raw[_VALUE.size:]), dtype=torch.uint8).view(dtype)
    return data[:n_full], (data[n_full:] if has_swa else None)


def chain_seed(model_id: str, layout: KVLayout, page_size: int, dtype: torch.dtype) -> bytes:
    """Start of every page-hash chain: a different model, layout, page size or dtype never matches."""
    return blake3.blake3(f"mmserve-kv-v1|{model_id}|{layout}|{page_size}|{dtype}".encode()).digest()


def page_hash(prev: bytes, page_key: tuple) -> bytes:
    """Hash of a page given the previous page's hash: its tokens and media keys, and (through the
    chain) everything before it."""
    h = blake3.blake3(prev)
    if all(type(t) is int for t in page_key):  # tagged so the two encodings can never coincide
        h.update(b"I" + array("q", page_key).tobytes())
    else:
        h.update(b"M")
        for t in page_key:
            if type(t) is int:
                h.update(b"t" + t.to_bytes(8, "little", signed=True))
            else:
                tid, key = t
                h.update(b"m" + tid.to_bytes(8, "little", signed=True) + len(key).to_bytes(4, "little") + key)
    return h.digest()
