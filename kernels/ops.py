"""Dispatch: CUDA tensors take the Triton kernels (when importable), everything else the torch
references. ``force_triton(True)`` sends every call to Triton (used with TRITON_INTERPRET=1 in tests).

The Triton kernels are filled in by the kernels work (issue G); until a kernel exists its dispatch
falls back to the reference, so callers never need to know.
"""

from __future__ import annotations

import torch

from kernels import attention_ref, kv_copy_ref, moe_ref

_FORCE_TRITON = False


def force_triton(enabled: bool) -> None:
    """Route every op through Triton even for CPU tensors (only meaningful with TRITON_INTERPRET=1)."""
    global _FORCE_TRITON
    _FORCE_TRITON = enabled


def use_triton(t: torch.Tensor) -> bool:
    return _FORCE_TRITON or t.is_cuda


def paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, page_size, scale,
                    window=None, sinks=None):
    return attention_ref.paged_attention_ref(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
        page_size=page_size, scale=scale, window=window, sinks=sinks,
    )


def store_kv(k_cache, v_cache, slot_mapping, k, v) -> None:
    kv_copy_ref.store_kv_ref(k_cache, v_cache, slot_mapping, k, v)


def route(router_logits, correction_bias, *, top_k, n_group=1, topk_group=1, renormalize=True,
          routed_scaling_factor=1.0):
    return moe_ref.route_ref(
        router_logits, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
        renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
    )


def fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids):
    return moe_ref.experts_ref(x, w_gate_up, w_down, topk_weights, topk_ids)


def band_attention(q, k, v, cu_seqlens, *, scale, window=None, sinks=None):
    """Bidirectional varlen attention within each [cu_seqlens[i], cu_seqlens[i+1]) segment; with
    ``window`` a token sees only keys within ±window positions; optional per-head sinks."""
    from kernels import band_attention_ref

    return band_attention_ref.band_attention_ref(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)
