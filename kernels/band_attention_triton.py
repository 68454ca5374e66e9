"""Triton varlen bidirectional band attention (vision ViT); contract of
:func:`kernels.band_attention_ref.band_attention_ref`.

Packed rows, segments ``[cu[s], cu[s+1])``; query i sees key j iff same segment and |i - j| <= w:

    segment:   cu[s] .......... [q0 - w ...... q0 .. q_last ...... q_last + w] .......... cu[s+1]
                                 \\__________ keys of one query block ________/
                                 (clipped to the segment)

The program layout is the one of :mod:`kernels.paged_attention_triton`: a tile row is one (query
token, GQA head) pair, and request-owner lookup by binary search is reused with ``cu_seqlens`` in
place of ``query_start_loc`` (segment s owns program ids [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1)).
Keys are contiguous rows of k/v, so there is no page table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention_triton import (
    LOG2E,
    check_attention_args,
    dim_blocks,
    dot_precision,
    find_owner,
    softmax_tile_update,
)


@triton.jit(do_not_specialize=["num_segments"])
def band_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, sinks_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    num_segments, window, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = find_owner(cu_ptr, num_segments, pid, BLOCK_Q)
    seg_begin = tl.load(cu_ptr + seg)
    seg_end = tl.load(cu_ptr + seg + 1)
    q0 = seg_begin + (pid - (seg_begin // BLOCK_Q + seg)) * BLOCK_Q
    if q0 >= seg_end:
        return

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // BLOCK_G
    grp = rows % BLOCK_G
    head = kvh * GROUP + grp
    row_ok = (tok < seg_end) & (grp < GROUP)
    tok64 = tok.to(tl.int64)

    d0 = tl.arange(0, BLOCK_D0)
    q_rows = q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh
    q_a = tl.load(q_rows + d0[None, :], mask=row_ok[:, None] & (d0[None, :] < HEAD_DIM), other=0.0)
    if BLOCK_D1 > 0:
        d1 = BLOCK_D0 + tl.arange(0, BLOCK_D1)
        q_b = tl.load(q_rows + d1[None, :], mask=row_ok[:, None] & (d1[None, :] < HEAD_DIM), other=0.0)
    dv = tl.arange(0, BLOCK_DV)

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=grp < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    k_lo = seg_begin
    k_hi = seg_end
    if HAS_WINDOW:
        last_tok = tl.minimum(q0 + BLOCK_Q, seg_end) - 1
        k_lo = tl.maximum(q0 - window, seg_begin)
        k_hi = tl.minimum(last_tok + window + 1, seg_end)
    for start in range(k_lo, k_hi, BLOCK_N):
        k_tok = start + tl.arange(0, BLOCK_N)
        k_ok = k_tok < k_hi
        k64 = k_tok.to(tl.int64)
        k_cols = k_ptr + k64[None, :] * stride_kt + kvh * stride_kh
        k_a = tl.load(k_cols + d0[:, None], mask=k_ok[None, :] & (d0[:, None] < HEAD_DIM), other=0.0)
        s = tl.dot(q_a, k_a, input_precision=DOT_PRECISION)
        if BLOCK_D1 > 0:
            k_b = tl.load(k_cols + d1[:, None], mask=k_ok[None, :] & (d1[:, None] < HEAD_DIM), other=0.0)
            s += tl.dot(q_b, k_b, input_precision=DOT_PRECISION)
        visible = row_ok[:, None] & k_ok[None, :]
        if HAS_WINDOW:
            dist = k_tok[None, :] - tok[:, None]
            visible = visible & (dist <= window) & (dist >= -window)
        v = tl.load(v_ptr + k64[:, None] * stride_vt + kvh * stride_vh + dv[None, :],
                    mask=k_ok[:, None] & (dv[None, :] < V_DIM), other=0.0)
        m_i, l_i, acc = softmax_tile_update(s * scale_log2, visible, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < V_DIM))


def band_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Bidirectional varlen (optionally ±window band) attention with sinks and GQA -> [N, Hq, Dv].

    q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv]; cu_seqlens [S+1] rising from 0 to N. ``block_n``
    (keys per tile, power of two >= 16) exists so tests reach several tiles on tiny segments.
    """
    check_attention_args(q, k, v, sinks, k_name="k", v_name="v")
    num_tokens, num_heads, head_dim = q.shape
    num_kv, v_dim = k.shape[1], v.shape[2]
    if k.shape[0] != num_tokens:
        raise ValueError(f"q has {num_tokens} rows but k/v have {k.shape[0]}")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None, got {window}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int tensor [S+1], got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if not cu_seqlens.is_cuda:  # host check is free here; on device it would force a sync
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to {num_tokens}, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    out = q.new_empty(num_tokens, num_heads, v_dim)
    num_segments = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_segments == 0:
        return out
    group = num_heads // num_kv
    block_g = triton.next_power_of_2(group)
    block_q = max(1, 64 // block_g)
    block_d0, block_d1 = dim_blocks(head_dim)
    cu_dev = cu_seqlens.to(device=q.device, dtype=torch.int64)
    grid = (num_tokens // block_q + num_segments, num_kv)
    band_attention_kernel[grid](
        q, k, v, out, cu_dev, sinks if sinks is not None else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        num_segments, window or 0, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_D0=block_d0, BLOCK_D1=block_d1, BLOCK_DV=max(16, triton.next_power_of_2(v_dim)),
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, DOT_PRECISION=dot_precision(q.dtype),
    )
    return out
