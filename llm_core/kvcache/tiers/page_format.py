"""A KV page outside L1: copies between L1 pages and host rows, its bytes in L3, its content-hash key.

A row holds one page of one kind over every layer of that kind (the layout is drawn in
host_kv_pool.py). In L3 a page is stored under ``store_key(hash)`` as

    [ header: magic "KVP1" | has_swa | itemsize | full_elems | swa_elems ][ Full row ][ SWA row ]?

and the hash chains each page's tokens (and media keys) onto the previous page's hash, starting from
a seed naming the model, layout, page size and dtype (docs/kv_cache.md §8).
"""

from __future__ import annotations

import struct
from array import array

import blake3
import torch

from kernels import ops
from llm_core.kvcache.dual_pool import DualKVPool, KVLayout


# ---- L1 <-> rows ----------------------------------------------------------------------------------
def _slots(pages: list[int], page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of whole pages (page -1 -> slot 0, marked invalid) and the per-slot validity mask."""
    t = torch.tensor(pages, dtype=torch.long)
    valid = (t >= 0).repeat_interleave(page_size)
    slots = (t.clamp(min=0)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return slots.to(device, non_blocking=True), valid.to(device, non_blocking=True)  # fresh host tensors


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


def layer_columns(layout: KVLayout, page_size: int, layer: int) -> slice:
    """The columns of a row of ``layer``'s kind that hold that layer: its K, then its V."""
    kind = layout.layer_kinds[layer]
    layers = layout.full_layers if kind == "full" else layout.swa_layers
    spec = layout.full if kind == "full" else layout.sliding
    per_layer = page_size * spec.elements_per_token()
    start = layers.index(layer) * per_layer
    return slice(start, start + per_layer)


def scatter_layer(pool: DualKVPool, layer: int, pages: list[int], part: torch.Tensor) -> None:
    """Write ``part`` -- layer ``layer``'s columns (``layer_columns``) of rows of its kind, one per
    page: [len(pages), per_layer] -- into L1 ``pages``. Only this layer's bytes go to the device."""
    kind = pool.layout.layer_kinds[layer]
    spec = pool.layout.full if kind == "full" else pool.layout.sliding
    ps, n = pool.page_size, len(pages)
    k_cache, v_cache = pool.layer(layer)
    k_len = ps * spec.num_kv_heads * spec.head_dim
    if part.shape != (n, ps * spec.elements_per_token()):
        raise ValueError(f"layer {layer}'s part of {n} rows must be [{n}, {ps * spec.elements_per_token()}], "
                         f"got {tuple(part.shape)}")
    if k_cache.is_cuda:  # staged in page-locked memory: an asynchronous copy, the loader never
        part = part.pin_memory()  # waits on the copy stream (torch keeps the block until it is done)
    part = part.to(k_cache.device, non_blocking=True)
    slots, valid = _slots(pages, ps, k_cache.device)
    k = part[:, :k_len].reshape(n * ps, spec.num_kv_heads, spec.head_dim)
    v = part[:, k_len:].reshape(n * ps, spec.num_kv_heads, spec.v_head_dim)
    ops.scatter_slots(k_cache, slots, k, valid)
    ops.scatter_slots(v_cache, slots, v, valid)


# ---- L3 value format and keys ----------------------------------------------------------------------
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


def store_key(h: bytes) -> str:
    """The L3 store key of the page with chain hash ``h``."""
    return "kv/" + h.hex()
