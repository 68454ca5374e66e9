"""The text model's attention for training: transformers' eager math (sinks included) through
``F.scaled_dot_product_attention``.

Why: HF's ``eager`` is the only built-in path that honours MiMo's attention sinks, and it keeps a
[B, H, L, L] float32 logit tensor per layer (plus the mask add, the max-subtract and the softmax
copies) for backward; a batch of two 60 s videos (2 x 1019 tokens) spends ~60 % of its step there.
SDPA computes the same softmax without those copies. Sinks enter as one extra key per head whose
logit is the sink itself (:mod:`mm_pipeline.training.sink_key`): exactly eager's "append the sink
logit, softmax, drop the column".

    from mm_pipeline.training.text_attention import SDPA_SINKS   # registers on import
    hf_config._attn_implementation = SDPA_SINKS

The mask is transformers' own ``sdpa_mask`` (boolean, causal + sliding window + padding), never
the ``is_causal`` shortcut, so the sliding layers' window is always explicit.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mm_pipeline.training.sink_key import sdpa_with_sinks

SDPA_SINKS = "mmserve_sink_attention"  # a name with "sdpa" in it would be checked against _supports_sdpa


def _explicit_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def sdpa_sinks_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                         s_aux: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
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
    elif s_aux is None:
        # A query row that may see nothing (left padding) would give NaN; eager gives a uniform
        # row there, which nobody reads. Let it see everything instead.
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    out = sdpa_with_sinks(query, key, value, mask, scaling, s_aux)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SDPA_SINKS, sdpa_sinks_attention)
AttentionMaskInterface.register(SDPA_SINKS, _explicit_sdpa_mask)
