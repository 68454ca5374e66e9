"""Torch reference for paged attention over one KV pool (full or sliding kind).

Pool layout (shared by the engine, the kernels and the tier copies):

    k_cache: [num_slots, num_kv_heads, head_dim]      slot = page * page_size + offset
    v_cache: [num_slots, num_kv_heads, v_head_dim]
    block_table[b, p] = physical page holding logical page p of request b (-1: none / released)

A request b has ``seq_lens[b]`` tokens of context *including* the new tokens of this step; its new
tokens are ``q[query_start_loc[b]:query_start_loc[b+1]]`` at positions ``seq_len - n .. seq_len - 1``.
One function serves prefill, chunked prefill (extend) and decode.

Window semantics follow transformers: ``window`` counts visible keys *including* the query:

    query at position i sees keys j with  i - window < j <= i

    positions:  ... i-W  [i-W+1 ........ i]  i+1 ...
                          \\____ W keys ___/

Sinks: a per-head logit ``sinks[h]`` joins the softmax denominator and carries no value.
"""

from __future__ import annotations

import torch


def visible_key_range(seq_len: int, num_new: int, window: int | None) -> tuple[int, int]:
    """Logical key positions [first, seq_len) that any of the new queries may see."""
    first_query = seq_len - num_new
    first = 0 if window is None else max(0, first_query - window + 1)
    return first, seq_len


def attention_core_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Masked softmax attention with GQA and optional per-head sinks.

    q [Q, Hq, D], k [K, Hkv, D], v [K, Hkv, Dv], mask [Q, K] (True = visible) -> [Q, Hq, Dv].
    """
    num_heads, num_kv = q.shape[1], k.shape[1]
    group = num_heads // num_kv
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    logits = logits.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(num_heads, 1, 1).expand(num_heads, logits.shape[1], 1)
        probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    # A query with no visible key (cannot happen for causal attention) would give NaN; keep zeros.
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def gather_slots(block_table_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Physical slots of logical ``positions`` through one request's page table."""
    pages = block_table_row[positions // page_size]
    if bool((pages < 0).any()):
        bad = positions[pages < 0][0].item()
        raise RuntimeError(f"attention reads logical position {bad} whose page was released")
    return pages * page_size + positions % page_size


def paged_attention_ref(
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
) -> torch.Tensor:
    """Causal (optionally windowed) attention of new tokens over a paged cache -> [T, Hq, Dv].

    The new tokens' K/V must already be stored in the cache (see :func:`store_kv_ref`).
    """
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        num_new = end - start
        if num_new == 0:
            continue
        first, last = visible_key_range(seq_len, num_new, window)
        pos_k = torch.arange(first, last, device=q.device)
        pos_q = torch.arange(seq_len - num_new, seq_len, device=q.device)
        slots = gather_slots(block_table[b], pos_k, page_size)
        mask = pos_k[None, :] <= pos_q[:, None]
        if window is not None:
            mask &= pos_k[None, :] > pos_q[:, None] - window
        out[start:end] = attention_core_ref(
            q[start:end], k_cache[slots], v_cache[slots], mask, scale=scale, sinks=sinks
        )
    return out
