"""Triton fused MoE experts: tokens sorted by expert, grouped GEMMs, weighted combine.

Same contract as :func:`kernels.moe_ref.experts_ref` (routing stays in torch: ``moe_ref.route_ref``).

An *entry* is one (token, choice) pair, ``entry = token * top_k + k``. Entries are sorted by expert
and each expert's run is padded to a multiple of BLOCK_M, so every block of BLOCK_M sorted rows
belongs to exactly one expert and one grouped-GEMM program can use a single weight matrix:

    sorted_ids:   | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- | ...     (-- = pad, id N)
    block_expert: |     0       |      2      |      2      |      5      | ... E (unused block)

Everything is computed on the device without a host sync: the padded length is bounded by
``N + min(E, N) * (BLOCK_M - 1)`` and blocks past the real end carry expert id E and exit at once.

Skipped entries (``skipped=True``: ids equal to E mark another rank's expert under expert
parallelism) sort into a bucket E of their own; the down kernel writes zeros for that bucket's rows
(the combine then adds nothing for them) and blocks past it carry id E + 1.

    gate_up kernel: inter[entry] = silu(x[tok] @ Wg[e].T) * (x[tok] @ Wu[e].T)      [N, I]
    down kernel:    y[entry]     = w[entry] * inter[entry] @ Wd[e].T                [N, H]
    combine:        out[tok]     = sum_k y[tok * top_k + k]    (torch sum: deterministic, no atomics)

Block-FP8 weights (``BlockFP8``, kernels/block_fp8.py: values e4m3, one fp32 factor per block) are
read as stored: each weight tile is loaded as fp8, multiplied by its blocks' factors (one per output
column: BLOCK_K divides the block's bk, so a K tile sees one scale column) and cast to x's dtype
before the dot; x and the intermediate stay in x's dtype (weight-only FP8).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.block_fp8 import BlockFP8
from kernels.paged_attention_triton import dot_precision


@triton.jit(do_not_specialize=["num_entries"])
def moe_gate_up_kernel(
    x_ptr, w_ptr, inter_ptr, sorted_ids_ptr, block_expert_ptr, s_ptr,
    stride_xt, stride_we, stride_wn, stride_it, stride_se, stride_sn, num_entries, num_experts, hidden, inter_size,
    scale_bn, scale_bk, up_scale_row0,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk).to(tl.int64)
    if expert >= num_experts:
        return
    ids = tl.load(sorted_ids_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < num_entries
    tok = (ids // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    rk = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + rk) < hidden
        a = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # gate rows are [0, I), up rows [I, 2I) of the fused weight
        w_tile = w_expert + cols[None, :] * stride_wn + (k0 + rk)[:, None]
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w_tile, mask=w_mask, other=0.0)
        up = tl.load(w_tile + inter_size * stride_wn, mask=w_mask, other=0.0)
        if HAS_SCALE:  # block FP8: a K tile lies in one scale column (BLOCK_K divides scale_bk)
            s_col = s_ptr + expert * stride_se + k0 // scale_bk
            s_gate = tl.load(s_col + (cols // scale_bn) * stride_sn, mask=col_ok, other=0.0)
            s_up = tl.load(s_col + (up_scale_row0 + cols // scale_bn) * stride_sn, mask=col_ok, other=0.0)
            gate = (gate.to(tl.float32) * s_gate[None, :]).to(a.dtype)
            up = (up.to(tl.float32) * s_up[None, :]).to(a.dtype)
        acc_gate += tl.dot(a, gate, input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, up, input_precision=DOT_PRECISION)
    hidden_act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(inter_ptr + ids.to(tl.int64)[:, None] * stride_it + cols[None, :],
             hidden_act.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_entries"])
def moe_down_kernel(
    inter_ptr, w_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, s_ptr,
    stride_it, stride_we, stride_wn, stride_yt, stride_se, stride_sn, num_entries, num_experts, hidden, inter_size,
    scale_bn, scale_bk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk).to(tl.int64)
    if expert > num_experts:
        return
    ids = tl.load(sorted_ids_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < num_entries
    ids64 = ids.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    if expert == num_experts:  # skipped entries (or, without them, padding only): zero rows
        tl.store(y_ptr + ids64[:, None] * stride_yt + cols[None, :], tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                 mask=row_ok[:, None] & col_ok[None, :])
        return
    rk = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = (k0 + rk) < inter_size
        a = tl.load(inter_ptr + ids64[:, None] * stride_it + (k0 + rk)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_expert + cols[None, :] * stride_wn + (k0 + rk)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_SCALE:
            s_w = tl.load(s_ptr + expert * stride_se + (cols // scale_bn) * stride_sn + k0 // scale_bk,
                          mask=col_ok, other=0.0)
            w = (w.to(tl.float32) * s_w[None, :]).to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + ids64[:, None] * stride_yt + cols[None, :], acc * weight[:, None],
             mask=row_ok[:, None] & col_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort entries by expert, pad each run to ``block_m`` -> (sorted_ids [P], block_expert [P // block_m]).

    Pads hold id N (= number of entries); unused trailing blocks hold expert id ``num_experts``.
    """
    flat = topk_ids.reshape(-1)
    num_entries = flat.shape[0]
    order = flat.argsort(stable=True)
    # scatter_add, not bincount: bincount on CUDA reads the max id back to the host (a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    raw_start = counts.cumsum(0) - counts
    expert_sorted = flat[order]
    rank = torch.arange(num_entries, device=flat.device)
    # entry at sorted rank r of expert e lands at pad_start[e] + (r - raw_start[e])
    dest = (pad_end - padded)[expert_sorted] + rank - raw_start[expert_sorted]
    bound = num_entries + min(num_experts, num_entries) * (block_m - 1)
    bound = triton.cdiv(bound, block_m) * block_m
    sorted_ids = torch.full((bound,), num_entries, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, bound, block_m, device=flat.device)
    block_expert = torch.searchsorted(pad_end, block_starts, right=True).to(torch.int32)
    return sorted_ids, block_expert


def fused_experts_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor | BlockFP8,
    w_down: torch.Tensor | BlockFP8,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    skipped: bool = False,
) -> torch.Tensor:
    """Sum_k w_k * down_e(silu(gate_e x) * up_e x) -> [T, H]; drop-in for ``moe_ref.experts_ref``.

    x [T, H]; w_gate_up [E, 2I, H] (gate rows first); w_down [E, H, I]; topk_weights [T, k] float;
    topk_ids [T, k] int, in [0, E) or, with ``skipped``, [0, E] (E: contributes nothing). Block sizes
    are powers of two >= 16 (tests shrink them to reach tails). The weights are both x's dtype or both
    ``BlockFP8`` (gate_up with its gate and up rows blocked as 2 groups); then ``block_k`` shrinks to
    divide the FP8 blocks' bk. ``block_k`` left out: 64, or with FP8 weights and few entries per
    expert (decode) the blocks' bk up to 128 -- one scale load per weight tile; measured on an H100
    (MiMo shapes, H 4096, I 2048, 32 experts): 16 tokens 0.54 -> 0.41 ms (bf16 0.66), 1 token
    0.71 -> 0.53 ms (bf16 0.55); a 4096-token prefill is faster at 64 (7.4 vs 7.9 ms; bf16 6.3).
    """
    fp8 = isinstance(w_gate_up, BlockFP8)
    if fp8 != isinstance(w_down, BlockFP8):
        raise ValueError("w_gate_up and w_down must both be BlockFP8 or both tensors")
    if fp8:
        w_gate_up.check("w_gate_up")
        w_down.check("w_down")
        if w_gate_up.groups != 2 or w_down.groups != 1:
            raise ValueError(f"block-FP8 w_gate_up needs 2 row groups (gate, up) and w_down 1, got "
                             f"{w_gate_up.groups} and {w_down.groups}")
    gu = w_gate_up.values if fp8 else w_gate_up
    dn = w_down.values if fp8 else w_down
    if x.dim() != 2 or gu.dim() != 3 or dn.dim() != 3:
        raise ValueError(f"x must be [T, H], weights [E, 2I, H] and [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(gu.shape)}, {tuple(dn.shape)}")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gu.shape
    inter = two_inter // 2
    if two_inter % 2 or gu.shape[2] != hidden or dn.shape != (num_experts, hidden, inter):
        raise ValueError(f"weights {tuple(gu.shape)} / {tuple(dn.shape)} do not match x [T, {hidden}] "
                         f"(expected [E, 2I, {hidden}] and [E, {hidden}, I])")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids/topk_weights must both be [{num_tokens}, k], got {tuple(topk_ids.shape)}, "
                         f"{tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights float, got {topk_ids.dtype}, "
                         f"{topk_weights.dtype}")
    named = (("w_gate_up", gu), ("w_down", dn), ("topk_ids", topk_ids), ("topk_weights", topk_weights))
    for name, t in named:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    for name, t in (("w_gate_up", gu), ("w_down", dn)):
        if not fp8 and t.dtype != x.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != x dtype {x.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    top_k = topk_ids.shape[1]
    num_entries = num_tokens * top_k
    if num_entries == 0:
        return x.new_zeros(num_tokens, hidden)
    x = x if x.stride(-1) == 1 else x.contiguous()
    # Few entries per expert (decode) waste most of a tall block on padding.
    few = num_entries <= 4 * num_experts
    block_m = block_m or (16 if few else 64)
    if fp8:  # a K tile within one scale column: block_k divides both stacks' bk
        block_k = math.gcd(block_k or (128 if few else 64), w_gate_up.block[1], w_down.block[1])
    block_k = block_k or 64
    for name, b in (("block_n", block_n), ("block_k", block_k), ("block_m", block_m)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}"
                             + (" (block_k divides the FP8 blocks' bk)" if fp8 and name == "block_k" else ""))
    # with skipped entries: one more bucket (E) for them, so no block mixes them with an expert's rows
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts + skipped, block_m)
    num_blocks = block_expert.shape[0]
    precision = dot_precision(x.dtype)
    # without FP8: any tensor as the (unread) scale pointer, and blocks of 1
    sgu, sdn = (w_gate_up.scale_inv, w_down.scale_inv) if fp8 else (gu, dn)
    (gbn, gbk), (dbn, dbk) = (w_gate_up.block, w_down.block) if fp8 else ((1, 1), (1, 1))
    inter_act = x.new_empty(num_entries, inter)
    moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, gu, inter_act, sorted_ids, block_expert, sgu,
        x.stride(0), gu.stride(0), gu.stride(1), inter_act.stride(0), sgu.stride(0), sgu.stride(1),
        num_entries, num_experts, hidden, inter, gbn, gbk, w_gate_up.group_scale_rows if fp8 else 0,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, HAS_SCALE=fp8,
    )
    y = torch.empty(num_entries, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        inter_act, dn, y, weights, sorted_ids, block_expert, sdn,
        inter_act.stride(0), dn.stride(0), dn.stride(1), y.stride(0), sdn.stride(0), sdn.stride(1),
        num_entries, num_experts, hidden, inter, dbn, dbk,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, HAS_SCALE=fp8,
    )
    return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
