"""Attention sinks as one extra key, so ``F.scaled_dot_product_attention`` can compute them.

A sink is a per-head logit ``s_h`` that joins the softmax denominator and contributes no value:

    p_ij = exp(l_ij) / (exp(s_h) + sum_j' exp(l_ij'))

SDPA has no such term, but one more key does it exactly: give every query a constant-1 column,
give the sink key ``s_h / scale`` in that column and zeros elsewhere, and a zero value. Then
``scale * q . k_sink = s_h`` for every query. CPU SDPA's fused (flash) path needs q, k and v of
one head dim, a multiple of 8, so all three are zero-padded to the next multiple of 8 past the new
column (zero columns change no dot product; the output's extra columns are sliced off) -- with
33 / 32 dims it falls back to the math path, 2-5x slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, Lq, D], k / v [B, H, Lk, D / Dv] (heads already expanded), ``allowed`` boolean
    [B or 1, 1, Lq, Lk] -> [B, H, Lq, Dv]."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    b, h, lq, d = q.shape
    dv = v.shape[-1]
    width = (max(d + 1, dv) + 7) // 8 * 8
    q = F.pad(q, (0, width - d))
    q[..., d] = 1.0
    sink = F.pad((sinks.to(k.dtype) / scale).view(h, 1), (d, width - d - 1))  # s_h / scale at column d
    k = torch.cat([F.pad(k, (0, width - d)), sink.view(1, h, 1, width).expand(b, -1, -1, -1)], dim=2)
    v = F.pad(v, (0, width - dv, 0, 1))                                          # zero value for the sink
    allowed = torch.cat([allowed.expand(b, -1, lq, -1), allowed.new_ones(b, 1, lq, 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)[..., :dv]
