"""A decoder layer of an all-decode step as one C call (kernels/native/fused_layer.c).

Serves exactly the steps where each of the layer's parts would already run its own C kernel
(attention front and out, paged decode attention, the MoE router + experts or the dense MLP) and
every row is a C decode row: a decode, or a row of a short multi-token request (an MTP verify
step's 1 + k rows; ``AttentionPlan.native_every_row``), which the attention plan already serves as
decode rows with their own causal lengths. The same kernels run on the same inputs, chained in C,
so tokens and logprobs are unchanged. Anywhere else (a longer prefill chunk, more than MAX_ROWS
rows, tensor / expert parallelism, bf16, CUDA, a compiled step, the kernels off)
:meth:`FusedDecode.run` returns None and the layer runs part by part. An ambiguous routing choice
still defers to the torch router, as SparseMoE does.

:meth:`FusedDecode.run_rows` is the same call for the last layer of a short prefill step
(``DecoderLayer.forward_logits_rows``: every row's K/V, the output of the logits rows alone), whose
logits rows attend as decode rows of ``ForwardBatch.logits_batch``: the front over all of the
step's rows, the rest over the logits rows, as the part-by-part path runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu.moe import native_serves
from kernels.native import fused_layer as native
from kernels.native.decoder_layer import MAX_ROWS
from llm_core.model.forward_batch import ForwardBatch
from llm_core.model.layers.attention import Attention
from llm_core.model.layers.mlp import DenseMLP
from llm_core.model.layers.moe import SparseMoE
from llm_core.model.layers.norm import RMSNorm


class FusedDecode:
    """The one-call path of one decoder layer; holds the layer's packed weight pointers, rebuilt
    when a weight's storage changes (a cast, a re-layout)."""

    def __init__(self, attn: Attention, mlp: nn.Module, norm_in: RMSNorm, norm_post: RMSNorm) -> None:
        self.attn, self.mlp, self.norm_in, self.norm_post = attn, mlp, norm_in, norm_post
        self._consts: native.LayerConstants | None = None
        self._key: tuple[int, ...] | None = None
        self._slots = self._weight_slots()
        # single rank only: a row-parallel o_proj / down_proj or an expert shard needs its collectives;
        # the C experts read float weights, not block-FP8 ones
        self._eligible = type(attn.o_proj) is nn.Linear and (
            (isinstance(mlp, SparseMoE) and mlp.placement.ctx.world_size == 1 and mlp.experts.fp8_block is None)
            or (isinstance(mlp, DenseMLP) and type(mlp.down_proj) is nn.Linear))

    def __getstate__(self) -> dict:
        # the packed pointers (ctypes arrays) belong to this process: a copy or pickle rebuilds them
        return {**self.__dict__, "_consts": None, "_key": None}

    def run(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor | None:
        """x + attention + mlp of x's rows, or None where the part-by-part path serves."""
        return self._serve(x, batch, k_cache, v_cache)

    def run_rows(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor | None:
        """x + attention + mlp of x's ``rows`` (the step's logits rows) after every row's K/V went into
        the pool, or None where the part-by-part path serves (``forward_logits_rows``)."""
        if rows.shape[0] == 0:
            return None
        return self._serve(x, batch, k_cache, v_cache, pick=rows)

    def _serve(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
               pick: torch.Tensor | None = None) -> torch.Tensor | None:
        """The one call for every row of x (``pick`` None: each a decode row of ``batch``) or for the
        ``pick`` rows alone (each a decode row of ``batch.logits_batch()``), or None."""
        t = x.shape[0]
        r = t if pick is None else pick.shape[0]
        if not self._eligible or t > MAX_ROWS or not x.is_cpu or torch.compiler.is_compiling():
            return None
        mlp = self.mlp
        if isinstance(mlp, SparseMoE) and not native_serves(r, mlp.top_k, x.shape[-1]):
            return None
        attn = self.attn
        if pick is None:
            plan = attn._plan(batch, x)
        else:  # the logits rows' plan, without building their batch where this step's plan holds them
            plan = attn._rows_plan(batch, x, pick)
        # every row a C decode row: an all-decode step, or decodes with short multi-token requests
        # (an MTP verify step's 1 + k rows, each a decode row with its own causal length)
        if plan is None or not plan.native_every_row:
            return None
        consts = self._constants()
        if consts is None:
            return None
        step = self._step(batch, plan.native, x.dtype, pick)
        if step is None:
            return None
        got = native.decode_layer(consts, step, x, k_cache, v_cache, plan.native)
        if got is None:
            return None
        x1, h, out = got
        return out if out is not None else x1 + mlp._torch(h)

    def _step(self, batch: ForwardBatch, decode, dtype: torch.dtype, pick: torch.Tensor | None = None):
        """The step's packed metadata for this layer's pool, window and rotary setup (once per step);
        ``pick``: the rows whose output is wanted (``run_rows``), None for all."""
        attn = self.attn
        key = ("fused_decode", attn.is_sliding, attn.window, attn.rotary.rotary_dim, attn.rotary.theta, dtype,
               pick is not None)
        if key not in batch.step_cache:
            cos, sin = attn._rotary_tables(batch, dtype)
            slots = batch.swa_slot_mapping if attn.is_sliding else batch.full_slot_mapping
            batch.step_cache[key] = native.step_metadata(decode, cos, sin, slots, pick)
        return batch.step_cache[key]

    def _weight_slots(self) -> list[tuple[dict, str]]:
        """Where each weight the C call reads lives: (the owning module's parameter or buffer dict,
        name). A cast or re-layout assigns a new tensor into the same dict, so reading through these
        sees it, without nn.Module.__getattr__'s cost on every call (~10 us a layer at batch 1)."""
        attn, mlp = self.attn, self.mlp
        own = [(attn.qkv_proj._parameters, "weight"), (attn.o_proj._parameters, "weight"),
               (attn._parameters, "attention_sink_bias"), (self.norm_in._parameters, "weight"),
               (self.norm_post._parameters, "weight")]
        if isinstance(mlp, SparseMoE):
            return own + [(mlp.gate._parameters, "weight"), (mlp.gate._buffers, "e_score_correction_bias"),
                          (mlp.experts._parameters, "gate_up_proj"), (mlp.experts._parameters, "down_proj")]
        return own + [(mlp.gate_proj._parameters, "weight"), (mlp.up_proj._parameters, "weight"),
                      (mlp.down_proj._parameters, "weight")]

    def _constants(self) -> native.LayerConstants | None:
        key = native.weight_key(*[d[name] for d, name in self._slots])
        if key != self._key:
            self._consts, self._key = self._build(key), key
        return self._consts

    def _build(self, key: tuple[int, ...]) -> native.LayerConstants | None:
        attn, mlp, spec = self.attn, self.mlp, self.attn.spec
        with torch.no_grad():
            if isinstance(mlp, SparseMoE):
                weights = native.MoEWeights(mlp.gate.weight, mlp.gate.e_score_correction_bias,
                                            mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.top_k, mlp.n_group,
                                            mlp.topk_group, mlp.renormalize, mlp.routed_scaling_factor)
            else:
                weights = native.DenseWeights(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
            return native.layer_constants(
                hidden=self.norm_in.weight.shape[0], num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, v_head_dim=spec.v_head_dim, rotary_dim=attn.rotary.rotary_dim,
                norm_in=self.norm_in.weight, eps_in=self.norm_in.eps, w_qkv=attn.qkv_proj.weight,
                value_scale=attn.value_scale, scale=attn.scale, sinks=attn.attention_sink_bias,
                w_o=attn.o_proj.weight, norm_post=self.norm_post.weight, eps_post=self.norm_post.eps, mlp=weights,
                key=key)
