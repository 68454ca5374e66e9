"""Triton KV writes and tier copies; same contracts as :mod:`kernels.kv_copy_ref`.

Every op moves whole cache rows. A row is everything behind one slot (``[heads, dim]`` of a pool,
flattened), so one kernel serves K, V and any tier layout:

    cache  [num_slots, *row_shape]        row i = cache.view(num_slots, R)[i],  R = prod(row_shape)

    program (i, c) copies elements [c * BLOCK, (c + 1) * BLOCK) of row i.

A slot outside ``[0, num_slots)`` (padding < 0, or a row ``valid`` marks False) is never read or
written: the gather writes zeros for it, the scatter skips it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["num_slots"])
def store_kv_kernel(
    k_cache_ptr, v_cache_ptr, slot_ptr, k_ptr, v_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, num_slots,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_KD: tl.constexpr, BLOCK_VD: tl.constexpr,
):
    """Program (t, h): k_cache[slot[t], h] = k[t, h] and v_cache[slot[t], h] = v[t, h]."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    dk = tl.arange(0, BLOCK_KD)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + dk, mask=dk < HEAD_DIM)
    tl.store(k_cache_ptr + (slot * NUM_HEADS + h) * HEAD_DIM + dk, k.to(k_cache_ptr.dtype.element_ty),
             mask=dk < HEAD_DIM)
    dv = tl.arange(0, BLOCK_VD)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + dv, mask=dv < V_DIM)
    tl.store(v_cache_ptr + (slot * NUM_HEADS + h) * V_DIM + dv, v.to(v_cache_ptr.dtype.element_ty),
             mask=dv < V_DIM)


@triton.jit(do_not_specialize=["num_slots"])
def copy_rows_kernel(
    src_ptr, dst_ptr, slot_ptr, valid_ptr, num_slots, row_len,
    GATHER: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr,
):
    """GATHER: dst[i] = src[slot[i]] (zeros when skipped); else dst[slot[i]] = src[i]."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < row_len
    slot = tl.load(slot_ptr + i).to(tl.int64)
    take = (slot >= 0) & (slot < num_slots)
    if HAS_VALID:
        take = take & (tl.load(valid_ptr + i) != 0)
    i64 = i.to(tl.int64)
    if GATHER:
        rows = tl.load(src_ptr + slot * row_len + cols, mask=in_row & take, other=0.0)
        tl.store(dst_ptr + i64 * row_len + cols, rows.to(dst_ptr.dtype.element_ty), mask=in_row)
    else:
        if take:
            rows = tl.load(src_ptr + i64 * row_len + cols, mask=in_row)
            tl.store(dst_ptr + slot * row_len + cols, rows.to(dst_ptr.dtype.element_ty), mask=in_row)


def _check_slots(slots: torch.Tensor, count: int | None, device: torch.device, what: str) -> None:
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what} must be a 1-D int32/int64 tensor, got {tuple(slots.shape)} {slots.dtype}")
    if count is not None and slots.shape[0] != count:
        raise ValueError(f"{what} has {slots.shape[0]} entries for {count} rows")
    if slots.device != device:
        raise ValueError(f"{what} is on {slots.device}, the cache on {device}")


def _check_cache(cache: torch.Tensor, what: str) -> None:
    if cache.dim() < 2 or not cache.is_contiguous():
        raise ValueError(f"{what} must be a contiguous [slots, ...] tensor, got shape {tuple(cache.shape)}")


def store_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_cache[slot_mapping[t]] = k[t] (same for v); slots < 0 are padding and skipped.

    k_cache [S, H, D], v_cache [S, H, Dv] contiguous; k [T, H, D], v [T, H, Dv] may be strided views
    (e.g. slices of a fused qkv projection) as long as the last dim is contiguous.
    """
    _check_cache(k_cache, "k_cache")
    _check_cache(v_cache, "v_cache")
    if k_cache.dim() != 3 or v_cache.dim() != 3 or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"caches must be [S, H, D] and [S, H, Dv], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_tokens = k.shape[0]
    for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if x.shape != (num_tokens,) + tuple(cache.shape[1:]):
            want = ", ".join(map(str, (num_tokens,) + tuple(cache.shape[1:])))
            raise ValueError(f"{name} must be [{want}], got {tuple(x.shape)}")
        if x.device != cache.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {cache.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    _check_slots(slot_mapping, num_tokens, k_cache.device, "slot_mapping")
    if num_tokens == 0:
        return
    num_heads, head_dim, v_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    store_kv_kernel[(num_tokens, num_heads)](
        k_cache, v_cache, slot_mapping, k, v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.shape[0],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_KD=triton.next_power_of_2(head_dim), BLOCK_VD=triton.next_power_of_2(v_dim),
    )


def _valid_arg(valid: torch.Tensor | None, count: int, device: torch.device) -> torch.Tensor | None:
    if valid is None:
        return None
    if valid.shape != (count,) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a [{count}] bool tensor, got {tuple(valid.shape)} {valid.dtype}")
    if valid.device != device:
        raise ValueError(f"valid is on {valid.device}, the cache on {device}")
    return valid.view(torch.uint8)


def gather_slots_triton(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``cache[slots]`` as a new tensor; rows where ``valid`` is False come back zero (not read)."""
    _check_cache(cache, "cache")
    _check_slots(slots, None, cache.device, "slots")
    flags = _valid_arg(valid, slots.shape[0], cache.device)
    out = cache.new_empty((slots.shape[0],) + tuple(cache.shape[1:]))
    row_len = math.prod(cache.shape[1:])
    if slots.shape[0] and row_len:
        grid = (slots.shape[0], triton.cdiv(row_len, BLOCK))
        copy_rows_kernel[grid](cache, out, slots, flags if flags is not None else slots, cache.shape[0], row_len,
                               GATHER=True, HAS_VALID=flags is not None, BLOCK=BLOCK)
    return out


def scatter_slots_triton(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor | None = None
) -> None:
    """``cache[slots] = rows`` for the rows ``valid`` marks (all when None)."""
    _check_cache(cache, "cache")
    _check_slots(slots, rows.shape[0], cache.device, "slots")
    if rows.shape[1:] != cache.shape[1:] or rows.device != cache.device:
        raise ValueError(f"rows {tuple(rows.shape)} on {rows.device} do not fit cache rows "
                         f"{tuple(cache.shape[1:])} on {cache.device}")
    flags = _valid_arg(valid, slots.shape[0], cache.device)
    rows = rows.contiguous()
    row_len = math.prod(cache.shape[1:])
    if slots.shape[0] and row_len:
        grid = (slots.shape[0], triton.cdiv(row_len, BLOCK))
        copy_rows_kernel[grid](rows, cache, slots, flags if flags is not None else slots, cache.shape[0], row_len,
                               GATHER=False, HAS_VALID=flags is not None, BLOCK=BLOCK)
