"""The checkpoint's multi-token-prediction (MTP) layers: ``model.mtp.layers.{j}.*`` (docs/model.md §2.2).

One MTP layer turns (a token, the hidden state that preceded it) into a guess of the *next* token:

    x = eh_proj([ enorm(embed(t_q)) ; hnorm(h_{q-1}) ])        8192 -> 4096 on MiMo-V2.5
    x += self_attn(input_layernorm(x))                           sliding-window attention, own KV
    x += mlp(pre_mlp_layernorm(x))                               dense MLP (intermediate_size)
    h^mtp_q = final_layernorm(x)  ->  lm_head (shared)  ->  guess of t_{q+1}

``h`` is always the *final-normed* hidden state that went to the LM head (the main model's output,
or an MTP layer's), as sglang's EAGLE worker captures it.

**Row convention.** An MTP layer's row ``q`` holds token ``t_q`` and the hidden state of row
``q - 1``, so it depends on tokens ``<= q`` only: its KV can use the main model's slot of position
``q`` (same page tables, same prefix-cache pages, same rollback) and a cached prefix carries valid MTP
KV. sglang indexes the same pair at ``q - 1``; attention only sees relative positions, so the two agree
except for our extra row 0 (``t_0`` with a zero hidden state), one more key early in a sequence.

The layer's attention is shaped like the main model's sliding layers (KV heads, head dims, sinks,
rope base, window) and its KV lives in the SWA pool as extra sliding layers (``mtp_kv_layout``).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from llm_core.distributed.parallel_context import ParallelContext
from llm_core.kvcache.dual_pool import KVLayout
from llm_core.model.config import ModelConfig
from llm_core.model.forward_batch import ForwardBatch
from llm_core.model.layers.attention import Attention
from llm_core.model.layers.mlp import DenseMLP
from llm_core.model.layers.norm import RMSNorm

MTP_PREFIX = "model.mtp.layers."
_MTP_NAME = re.compile(r"^model\.mtp\.layers\.(\d+)\.")


def mtp_layer_count(tensor_names) -> int:
    """How many MTP layers a checkpoint holds (``model.mtp.layers.{j}.*``; 0 when none)."""
    found = {int(m.group(1)) for n in tensor_names if (m := _MTP_NAME.match(n))}
    if found and found != set(range(len(found))):
        raise ValueError(f"MTP layers must be numbered 0..n-1, found {sorted(found)}")
    return len(found)


def sliding_layer_config(config: ModelConfig) -> ModelConfig:
    """A one-layer view of ``config`` whose layer 0 is a sliding layer with a dense MLP: the shape of
    an MTP layer (the main model's sliding attention spec and window)."""
    return dataclasses.replace(config, num_layers=1, layer_kinds=("sliding",), mlp_kinds=("dense",))


class MTPLayer(nn.Module):
    """``model.mtp.layers.{j}``: parameter names are the checkpoint's. Under tensor parallelism
    (``parallel``) its attention heads and MLP split like a main sliding layer's; ``eh_proj`` (and the
    norms) stay whole on every rank: its input is the replicated residual stream."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(sliding_layer_config(config), 0, parallel)
        self.pre_mlp_layernorm = RMSNorm(h, eps)  # the post-attention norm of this decoder layer
        self.mlp = DenseMLP(h, config.intermediate_size, parallel)
        self.final_layernorm = RMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, h_prev: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [T, H] of the batch's rows; writes this layer's K/V at the batch's
        SWA slots. ``embeds`` are the rows' token embeddings (media rows spliced in), ``h_prev`` the
        final-normed hidden of each row's previous position (zeros where unknown)."""
        x = self._input(embeds, h_prev)
        x = x + self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache)
        x = x + self.mlp(self.pre_mlp_layernorm(x))
        return self.final_layernorm(x)

    def write_kv(self, embeds: torch.Tensor, h_prev: torch.Tensor, batch: ForwardBatch,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Only this layer's K/V of the batch's rows, bit for bit what ``forward`` stores: a layer's
        K/V depend on its input projection alone, so an extend whose outputs nothing reads (the last
        MTP layer that keeps KV) skips attention, MLP and final norm (docs/speculative.md)."""
        self.self_attn.write_kv(self.input_layernorm(self._input(embeds, h_prev)), batch, k_cache, v_cache)

    def _input(self, embeds: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        h_prev = h_prev if h_prev.dtype == embeds.dtype else h_prev.to(embeds.dtype)
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(h_prev)], dim=-1))


class MTPHead(nn.Module):
    """``model.mtp``: the checkpoint's MTP layers (embeddings and LM head are the main model's)."""

    def __init__(self, config: ModelConfig, num_layers: int, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an MTP head needs at least one layer, got {num_layers}")
        self.layers = nn.ModuleList(MTPLayer(config, parallel) for _ in range(num_layers))


def mtp_kv_layout(layout: KVLayout, num_layers: int, sliding_window: int) -> KVLayout:
    """``layout`` plus ``num_layers`` sliding layers past the model's own: the MTP layers that keep
    KV (their attention is a sliding layer's, so their KV lives in the SWA pool)."""
    return KVLayout(layout.layer_kinds + ("sliding",) * num_layers, layout.full, layout.sliding,
                    layout.window if layout.window is not None else sliding_window)


def mtp_head_of(model: nn.Module) -> MTPHead | None:
    """The MTP head the loader attached to a MiMoV2ForCausalLM (``model.model.mtp``), or None."""
    return getattr(getattr(model, "model", None), "mtp", None)
