"""The text model's attention for training: transformers' eager math (sinks included) through
``F.scaled_dot_product_attention``.

Why: HF's ``eager`` is the only built-in path that honours MiMo's attention sinks, and it keeps a
[B, H, L, L] float32 logit tensor per layer (plus the mask add, the max-subtract and the softmax
copies) for backward; a batch of two 60 s videos (2 x 1019 tokens) spends ~60 % of its step there.
SDPA computes the same softmax without those copies. Sinks enter as one extra key per head whose
logit is the sink itself (:mod:`samples.training.attention.sink_key`): exactly eager's "append the sink
logit, softmax, drop the column".

    from samples.training.attention.text_attention import SDPA_SINKS   # registers on import
    hf_config._attn_implementation = SDPA_SINKS

The mask is transformers' own ``sdpa_mask`` (boolean, causal + sliding window + padding), never
the ``is_causal`` shortcut, so the sliding layers' window is always explicit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from samples.training.attention.band_chunks import chunk_rows, span_rows
from samples.training.attention.sink_key import sdpa_with_sinks

SDPA_SINKS = "mmserve_sink_attention"  # a name with "sdpa" in it would be checked against _supports_sdpa


def _explicit_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def sdpa_sinks_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                         s_aux: torch.Tensor | None = None, sliding_window: int | None = None,
                         **_: Any) -> tuple[torch.Tensor, None]:
    """query [B, Hq, Lq, D], key/value [B, Hkv, Lk, D], boolean mask [B, 1, Lq, Lk] (True = attend)
    -> ([B, Lq, Hq, Dv], None)."""
    if dropout:
        raise ValueError("the demo text model trains without attention dropout")
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    lq = query.shape[2]
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"{SDPA_SINKS} expects transformers' boolean sdpa mask, got {mask.dtype}")
    if mask is None:
        mask = torch.ones(1, 1, lq, key.shape[2], dtype=torch.bool, device=query.device)
    if sliding_window is not None and lq == key.shape[2] and lq > 3 * sliding_window:
        out = _banded(query, key, value, mask, scaling, s_aux, sliding_window)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    out = sdpa_with_sinks(query, key, value, _no_empty_rows(mask, s_aux), scaling, s_aux)
    return out.transpose(1, 2).contiguous(), None


def _no_empty_rows(mask: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """A query row that may see nothing (left or chunk padding) would give NaN; eager gives a
    uniform row there, which nobody reads. Let it see everything instead (a sink row is never empty)."""
    return mask if sinks is not None else mask | ~mask.any(dim=-1, keepdim=True)


def _banded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
            sinks: torch.Tensor | None, window: int) -> torch.Tensor | None:
    """A sliding layer's attention computed on its band only: queries in chunks of ``window``
    rows, each against the ``2 * window`` keys before its end, with transformers' own mask cut
    into the same blocks -- so a 1019-token video costs 32 chunks x 32 x 64 instead of 1019^2.
    Returns None (caller goes dense) if the mask lets a query see past the band."""
    b, h, length, _ = query.shape
    chunk, n_chunks = window, -(-length // window)
    padded = n_chunks * chunk
    mask = mask.expand(b, -1, -1, -1)[:, 0]                                       # [B, L, L]
    mask_p = F.pad(mask, (window, padded - length, 0, padded - length))           # [B, P, w + P]
    cols = torch.arange(n_chunks)[:, None] * chunk + torch.arange(window + chunk)[None]   # [C, span]
    rows = torch.arange(padded).view(n_chunks, chunk)                               # [C, chunk]
    blocks = mask_p[:, rows[:, :, None], cols[:, None, :]]                          # [B, C, chunk, span]
    if int(blocks.sum()) != int(mask.sum()):
        return None

    def flat(x: torch.Tensor) -> torch.Tensor:                                      # [B, H, C, n, D] -> [B*C, H, n, D]
        return x.transpose(1, 2).flatten(0, 1)

    allowed = _no_empty_rows(blocks.flatten(0, 1)[:, None], sinks)
    out = sdpa_with_sinks(flat(chunk_rows(query, 2, chunk)), flat(span_rows(key, 2, chunk, window, 0)),
                          flat(span_rows(value, 2, chunk, window, 0)), allowed, scale, sinks)   # [B*C, H, chunk, Dv]
    return out.unflatten(0, (b, n_chunks)).transpose(1, 2).flatten(2, 3)[:, :, :length]


AttentionInterface.register(SDPA_SINKS, sdpa_sinks_attention)
AttentionMaskInterface.register(SDPA_SINKS, _explicit_sdpa_mask)
