"""Torch references for writing new K/V into pool slots and moving slots between tiers."""

from __future__ import annotations

import torch


def store_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    all_valid: bool = False,
) -> None:
    """k_cache[slot_mapping[t]] = k[t] (same for v); slots < 0 are padding and skipped
    (``all_valid``: the caller guarantees there are none; no check, so no host sync)."""
    if all_valid or bool((slot_mapping >= 0).all()):  # index_copy_: the same rows written as by
        # indexing, at less dispatch cost; .to() only when the dtypes differ (a no-op is still a dispatch)
        k_cache.index_copy_(0, slot_mapping, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))
    else:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache[slots] = k[keep].to(k_cache.dtype)
        v_cache[slots] = v[keep].to(v_cache.dtype)


def gather_slots_ref(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``cache[slots]``; rows where ``valid`` is False come back zero (not read)."""
    if valid is None:
        return cache[slots].clone()
    out = cache.new_zeros((slots.shape[0],) + tuple(cache.shape[1:]))
    out[valid] = cache[slots[valid]]
    return out


def scatter_slots_ref(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor | None = None
) -> None:
    """``cache[slots] = rows`` for the rows ``valid`` marks (all when None)."""
    if valid is None:
        cache[slots] = rows.to(cache.dtype)
    else:
        cache[slots[valid]] = rows[valid].to(cache.dtype)
