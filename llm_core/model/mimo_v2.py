"""The MiMo-V2 hybrid SWA / MoE text model over the engine's paged KV pools.

Parameter names follow the checkpoints (``model.layers.{i}.self_attn.qkv_proj.weight``,
``...mlp.experts.gate_up_proj`` ...) so the loader maps tensors by name; see llm_core/model/loader.py for
the few conversions (split q/k/v -> fused rows, per-expert -> stacked, FP8 -> dtype).

One forward step serves prefill, chunked prefill and decode of a whole flat batch (ForwardBatch):

    x = embed(ids) | inputs_embeds
    for each layer i:   x += Attn_i(RMSNorm(x))      (KV into pool of kind layer_kinds[i])
                        x += MLP_i(RMSNorm(x))       (dense or MoE, per mlp_kinds[i])
    return RMSNorm(x)                                 -> compute_logits picks rows -> lm_head (fp32)
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kernels import ops
from kernels.block_fp8 import FP8_DTYPE
from kernels.native import greedy_head
from kernels.native.greedy_head import lm_head_argmax
from llm_core.distributed.parallel_context import ParallelContext
from llm_core.kvcache.dual_pool import KVLayout
from llm_core.distributed.parallel_layers import embedding, lm_head
from llm_core.model.config import ModelConfig
from llm_core.model.forward_batch import ForwardBatch
from llm_core.model.layers.attention import Attention
from llm_core.model.layers.fused_decode import FusedDecode
from llm_core.model.layers.mlp import DenseMLP
from llm_core.model.layers.moe import SparseMoE, StackedExperts
from llm_core.model.layers.norm import RMSNorm


class KVBuffers(Protocol):
    """What the model needs from a KV pool: per layer, the (k_cache, v_cache) of that layer's kind."""

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, parallel)
        if config.mlp_kinds[layer] == "moe":
            self.mlp: nn.Module = SparseMoE(config, parallel)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # an all-decode step's layer as one C call where every part would run its own C kernel
        self.fused_decode = FusedDecode(self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        fused = self.fused_decode.run(x, batch, k_cache, v_cache)
        if fused is not None:
            return fused
        attn = self.self_attn.attend(x, batch, k_cache, v_cache, norm=self.input_layernorm)
        x, h = self.self_attn.residual_out(attn, x, self.post_attention_layernorm)
        return self.mlp(h, residual=x)

    def forward_logits_rows(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """The last layer under ``batch.logits_only``: every row's K/V into the pool, then the rest of
        the layer for the logits rows alone -> [R, hidden] (the other rows' outputs feed nothing)."""
        rows = batch.logits_indices
        fused = self.fused_decode.run_rows(x, batch, k_cache, v_cache, rows)
        if fused is not None:
            return fused
        attn = self.self_attn.attend_rows(x, batch, k_cache, v_cache, rows, norm=self.input_layernorm)
        if rows.shape[0] == 0:  # a prompt chunk that samples nothing: only its K/V was needed
            return x[:0]
        x, h = self.self_attn.residual_out(attn, x.index_select(0, rows), self.post_attention_layernorm)
        return self.mlp(h, residual=x)


class TextBackbone(nn.Module):
    """``model.*`` of the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, i, parallel) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MiMoV2ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext | None = None) -> None:
        """``parallel``: this rank's share under tensor / expert parallelism (default: the whole model)."""
        super().__init__()
        self.config = config
        self.parallel = parallel or ParallelContext.single()
        self.model = TextBackbone(config, self.parallel)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, self.parallel)
        self.tie_weights_()

    def tie_weights_(self) -> None:
        """Share the embedding matrix with lm_head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_kernel_layouts_(self) -> None:
        """Re-lay the weights in the layouts the device's kernels read fastest (same shapes and values):
        the expert stacks (``kernels.ops.expert_weight_layout``) and every linear weight
        (``kernels.ops.linear_weight_layout``) except one tied to the embedding, whose lookups gather
        whole rows. Called once by the model runner after loading; idempotent."""
        tied = self.model.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, StackedExperts):
                module.use_kernel_layout_()
            elif isinstance(module, nn.Linear) and module.weight is not tied:
                module.weight.data = ops.linear_weight_layout(module.weight.data)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (the multimodal path splices media rows into these)."""
        vocab = self.config.vocab_size
        # one reduction and two host reads instead of four ops: in a decode step each op runs with
        # the caches cold (the weights streamed through them since the last step), ~30-60 us apiece
        lo, hi = torch.aminmax(input_ids) if input_ids.numel() else (0, 0)
        if int(lo) < 0 or int(hi) >= vocab:
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)][0].item()
            raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab})")
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        batch: ForwardBatch,
        kv: KVBuffers,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the batch's T new tokens ([R, hidden] of its
        logits rows when ``batch.logits_only``: see ``ForwardBatch.logits_hidden``).

        Give exactly one of ``input_ids`` [T] and ``inputs_embeds`` [T, hidden]. Writes each layer's
        new K/V into ``kv.layer(i)`` at the batch's slot mapping of that layer's kind.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if x.dim() != 2 or x.shape[0] != batch.num_tokens or x.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"inputs have shape {tuple(x.shape)}; expected [{batch.num_tokens}, {self.config.hidden_size}]"
            )
        x = x.to(self.model.norm.weight.dtype)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = kv.layer(i)
            if i == last and batch.logits_only:
                x = layer.forward_logits_rows(x, batch, k_cache, v_cache)
            else:
                x = layer(x, batch, k_cache, v_cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] in fp32 for the rows the engine picked (batch.logits_indices); under
        tensor parallelism each rank computes its vocabulary slice and rank 0, the one that samples,
        gathers them (the other ranks get None)."""
        logits = self.lm_head(hidden)
        return self.parallel.gather_tp_last(logits if logits.dtype == torch.float32 else logits.float())

    def compute_logits_rows(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``compute_logits`` of rows ``[start, stop)`` of a forward's every-row output (prompt
        logprobs: a block at a time; the parallel mirror names the rows to every rank)."""
        return self.compute_logits(hidden[start:stop])

    def greedy_ids(self, hidden: torch.Tensor) -> list[int] | None:
        """The argmax token of each row's logits, ``compute_logits(hidden).argmax(-1)``, without handing
        logits to the sampler (kernels/native/greedy_head.c: the LM head's GEMM with a running argmax per
        row on AVX-512, its GEMM then a scan elsewhere);
        None when that kernel cannot serve the call (kernels off, not fp32 CPU, a tied or row-major
        head, a NaN logit), for as many rows as MKL's GEMM + argmax serves as fast (one row: its GEMV;
        on a build without AVX-512 more than 8: ``greedy_head.pays``) or when the vocabulary is split
        across tensor-parallel ranks. The runner asks for it only when every sampling row is greedy
        without logprobs."""
        # (a CUDA step never asks pays: it would build the CPU kernel for nothing)
        if self.parallel.tp_size != 1 or not hidden.is_cpu or not greedy_head.pays(hidden.shape[0]):
            return None
        return lm_head_argmax(hidden, self.lm_head.weight)

    def kv_layout(self) -> KVLayout:
        """The KV geometry this rank stores: its own KV heads of each kind (all of them in one process)."""
        def local(kind: str):
            return self.parallel.heads(self.config.full_attn if kind == "full" else self.config.swa_attn, kind).local

        return KVLayout.from_specs(self.config, local("full"), local("sliding"))

    def cast_(self, dtype: torch.dtype) -> MiMoV2ForCausalLM:
        """Cast floating tensors to ``dtype`` in place, except the router (kept fp32 like the checkpoint)
        and block-FP8 expert values (kept as stored)."""
        for module in self.modules():
            if getattr(module, "FP32", False):
                continue
            for name, p in module.named_parameters(recurse=False):
                if p.is_floating_point() and p.dtype != FP8_DTYPE:
                    setattr(module, name, nn.Parameter(p.data.to(dtype), requires_grad=p.requires_grad))
        self.tie_weights_()
        return self
