"""Paged attention for CPU tensors: one fused attention call per step part, its index work done once
per step (:class:`kernels.cpu.attention_plan.AttentionPlan`).

Same contract and results (to fp32 rounding) as :func:`kernels.attention_ref.paged_attention_ref`.
Decode rows, and the prefill rows the plan sends there, go to the C kernel
(kernels/native/paged_decode.c); the other multi-token requests to ATen's CPU flash kernel
(GQA-aware, reads K/V through strided views, so the gathered [D, K, Hkv, d] rows need no head-major
copy). It also returns the log-sum-exp, which gives the sinks exactly: a sink logit s joins only the
denominator, so

    out_with_sink = out * e^lse / (e^lse + e^s) = out * sigmoid(lse - s)
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels.cpu.attention_plan import AttentionPlan, decode_grid, Extend
from kernels.native import paged_decode

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend(q, k, v, mask, *, scale, sinks):
    """q [B, Q, Hq, d], k [B, K, Hkv, d], v [B, K, Hkv, dv], mask [B|1, 1, Q, K] -> [B, Q, Hq, dv].
    ``mask`` None: causal (Q == K)."""
    dv = v.shape[-1]
    d = q.shape[-1]
    if dv != d:  # the flash kernel wants one head size: zero columns change neither q.k nor p@v
        # (only the narrower tensors: a pad of nothing is still a copy, ~1 MB of gathered keys over a
        # long context)
        width = max(d, dv)
        q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    if _FLASH is not None:
        out, lse = _FLASH(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=mask is None,
                          attn_mask=mask, scale=scale)
    else:
        if mask is None:
            n = q.shape[1]
            mask = torch.zeros(n, n, dtype=q.dtype, device=q.device).masked_fill_(
                torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))[None, None]
        out, lse = _math_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale)
    # out [B, Hq, Q, w], lse [B, Hq, Q]
    if sinks is not None:  # in place on the kernel's own outputs: fewer dispatches, the same values
        gate = lse.sub_(sinks.view(1, -1, 1)).sigmoid_().unsqueeze(-1)
        # the gate is fp32 (from the kernel's fp32 lse): a bf16/fp16 output takes it in fp32 and
        # goes back to its own dtype, or the next projection (bf16 weights) meets an fp32 input
        out = out.mul_(gate) if out.dtype == gate.dtype else (out * gate).to(out.dtype)
    return (out if out.shape[-1] == dv else out[..., :dv]).transpose(1, 2)


def _math_attention(q, k, v, mask, scale):
    """Fallback with the flash kernel's outputs: q [B, Hq, Q, d], k/v [B, Hkv, K, *]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    logits = torch.matmul(q.float(), k.transpose(-1, -2)) * scale + mask.float()
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.softmax(logits, dim=-1), v).to(q.dtype), lse


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed, with sinks) attention of new tokens over a paged pool -> [T, Hq, Dv].

    ``plan``: the step's :class:`AttentionPlan` for this pool and window (built here when None).
    ``k_new`` [T, Hkv, d] / ``v_new`` [T, Hkv, dv]: the step's new keys and values as stored into the
    pool; chunks that see only their own tokens read them from here (None: always from the pool).
    """
    if plan is None:
        plan = AttentionPlan.build(block_table, query_start_loc, seq_lens, page_size=page_size, window=window,
                                   dtype=q.dtype, head_dim=q.shape[-1])
    if plan.num_tokens != q.shape[0]:
        raise ValueError(f"attention plan covers {plan.num_tokens} tokens, q has {q.shape[0]}")
    if plan.all_decode:
        return _decode(q, k_cache, v_cache, plan, scale=scale, sinks=sinks)
    if plan.decode_rows is None and len(plan.extends) == 1:  # one request's rows (a prompt chunk at
        # batch 1, an MTP verify step with the C kernel off): its attention is the whole output, no
        # buffer to scatter into
        return _extend(q, k_cache, v_cache, plan.extends[0], k_new, v_new, scale=scale, sinks=sinks)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[2])
    if plan.decode_rows is not None:
        _decode(q, k_cache, v_cache, plan, scale=scale, sinks=sinks, out=out)
    for e in plan.extends:
        out[e.start : e.end] = _extend(q, k_cache, v_cache, e, k_new, v_new, scale=scale, sinks=sinks)
    return out


def _extend(q, k_cache, v_cache, e: Extend, k_new, v_new, *, scale, sinks):
    """The query rows of one multi-token request -> [n, Hq, Dv]."""
    n, kn = e.end - e.start, e.slots.numel()
    if e.fresh and k_new is not None and v_new is not None:
        k, v = k_new[e.start : e.end][None], v_new[e.start : e.end][None]
    else:
        k = k_cache.index_select(0, e.slots).view(1, kn, k_cache.shape[1], k_cache.shape[2])
        v = v_cache.index_select(0, e.slots).view(1, kn, v_cache.shape[1], v_cache.shape[2])
    if e.band is not None:
        return e.band.attend(q[e.start : e.end], k[0], v[0],
                             lambda qb, kb, vb, mask: _attend(qb, kb, vb, mask, scale=scale, sinks=sinks))
    return _attend(q[e.start : e.end].view(1, n, -1, q.shape[2]), k, v, e.mask, scale=scale, sinks=sinks)[0]


def _decode(q, k_cache, v_cache, plan: AttentionPlan, *, scale, sinks, out=None):
    """The decode rows (one query per request) of q [T, Hq, d]: -> [D, Hq, Dv] when every row
    decodes (``plan.all_decode``), else written into their rows of ``out`` [T, Hq, Dv]."""
    if plan.native is not None and not torch.compiler.is_compiling():  # a compiled step keeps the
        # torch path: the C call would split its graph
        got = paged_decode.decode_attention(q, k_cache, v_cache, plan.native, scale=scale, sinks=sinks, out=out)
        if got is not None:
            return got
    slots, kmax, mask = plan.decode_slots, plan.decode_keys, plan.decode_mask
    if slots is None:  # the plan was made for the C kernel, which cannot take these tensors
        n = plan.native
        slots, kmax, mask = decode_grid(n.table[n.requests].to(q.device), n.seq_lens[n.requests].tolist(),
                                         page_size=n.page_size, window=n.window, keys=None, dtype=q.dtype)
    rows = None if plan.all_decode else plan.decode_rows
    qd = q if rows is None else q[rows]
    d_req = qd.shape[0]
    k = k_cache.index_select(0, slots).view(d_req, kmax, k_cache.shape[1], k_cache.shape[2])
    v = v_cache.index_select(0, slots).view(d_req, kmax, v_cache.shape[1], v_cache.shape[2])
    res = _attend(qd.view(d_req, 1, q.shape[1], q.shape[2]), k, v, mask, scale=scale, sinks=sinks)
    res = res.reshape(d_req, q.shape[1], v_cache.shape[2])
    if out is None:
        return res
    out[rows] = res
    return out
