"""Self-attention of one layer over its paged KV pool (full or sliding kind).

    [norm] x --qkv_proj--> [ q (Hq x D) | k (Hkv x D) | v (Hkv x Dv) ]      rows in this plain order
    q, k <- partial RoPE(positions);  v <- value_scale * v   (cached already scaled)
    store k, v at the batch's slots of this kind's pool, then paged attention over the pool
    (window and per-head sinks for sliding layers) --o_proj--> hidden

The steps up to the KV store run as one C call (kernels/native/decoder_layer.c, the layer's input
norm included), and o_proj with the residual add and the post-attention norm as another
(``residual_out``), for steps of up to ``MAX_ROWS`` rows (decode batches and short prefills such as
a question after a prefix-cache hit). Longer steps (a prompt) keep MKL's projections and do the glue
between them in C too: RoPE + value scale + KV store in one call, the norms and the residual add in
another (``rope_store`` / ``add_rms_norm``). Where a call cannot take the tensors, the torch ops below.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from kernels.native.decoder_layer import MAX_ROWS, add_rms_norm, attention_front, attention_out, rope_store
from llm_core.distributed.parallel_context import ParallelContext
from llm_core.distributed.parallel_layers import column_linear, row_linear
from llm_core.model.config import ModelConfig
from llm_core.model.forward_batch import ForwardBatch
from llm_core.model.layers.norm import RMSNorm
from llm_core.model.layers.rope import PartialRotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext.single()
        # Under tensor parallelism this rank's heads only (llm_core/distributed/parallel_context.py):
        # qkv_proj is column-parallel (its q/k/v head rows), o_proj row-parallel (one all-reduce).
        shard = parallel.heads(config.attn_spec(layer), config.layer_kinds[layer])
        spec = shard.local
        self.spec = spec
        self.is_sliding = config.layer_kinds[layer] == "sliding"
        self.window = config.window_of(layer)
        self.scale = spec.head_dim**-0.5  # the q/k dim, not the v dim
        self.value_scale = config.value_scale
        self.qkv_proj = column_linear(config.hidden_size, spec.q_size + spec.k_size + spec.v_size)
        self.o_proj = row_linear(spec.num_heads * spec.v_head_dim, config.hidden_size, parallel)
        if spec.has_sinks:
            self.attention_sink_bias = nn.Parameter(torch.zeros(spec.num_heads))
        else:
            self.register_parameter("attention_sink_bias", None)
        self.rotary = PartialRotary(spec.rotary_dim, spec.rope_theta)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """o_proj(attention) of x's rows; ``norm``: the layer's input norm, applied to x first (fused
        into the C front when it serves)."""
        return self.o_proj(self.attend(x, batch, k_cache, v_cache, norm))

    def attend(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
               norm: RMSNorm | None = None) -> torch.Tensor:
        """The attention of x's rows before o_proj: [T, Hq * Dv]."""
        spec = self.spec
        t = x.shape[0]
        q, k, v = self.write_kv(x, batch, k_cache, v_cache, norm)
        table = self._table(batch)
        out = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            table,
            batch.query_start_loc,
            batch.seq_lens,
            page_size=batch.page_size,
            scale=self.scale,
            window=self.window,
            sinks=self.attention_sink_bias,
            plan=self._plan(batch, q),
            k_new=k,
            v_new=v,
            decode_keys=batch.decode_keys,
        )
        return out.reshape(t, spec.num_heads * spec.v_head_dim)

    def attend_rows(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    rows: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """K/V of all of x's rows into the pool, then the attention of ``rows`` alone before o_proj:
        [R, Hq * Dv]. Each of those rows is the last new token of its request, so it attends as a
        decode row of ``batch.logits_batch()`` over the pool (which now holds the step's keys)."""
        spec = self.spec
        q, _, _ = self.write_kv(x, batch, k_cache, v_cache, norm)
        if rows.shape[0] == 0:
            return q.new_empty(0, spec.num_heads * spec.v_head_dim)
        plan = self._rows_plan(batch, q, rows)
        q = q.index_select(0, rows)
        if plan is not None:  # the CPU path reads the plan alone: no logits batch where the step's plan held the rows
            out = ops.paged_attention(q, k_cache, v_cache, None, None, None, page_size=batch.page_size,
                                      scale=self.scale, window=self.window, sinks=self.attention_sink_bias, plan=plan)
        else:  # a kernel that takes no plan (Triton) reads the logits batch's tables and lengths
            sub = batch.logits_batch()
            out = ops.paged_attention(q, k_cache, v_cache, self._table(sub), sub.query_start_loc, sub.seq_lens,
                                      page_size=sub.page_size, scale=self.scale, window=self.window,
                                      sinks=self.attention_sink_bias, decode_keys=sub.decode_keys)
        return out.reshape(rows.shape[0], spec.num_heads * spec.v_head_dim)

    def residual_out(self, attn: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + o_proj(attn), norm of that): the residual add and the post-attention norm, in one C call
        (kernels/native/decoder_layer.c) where the C front serves, else in torch."""
        if type(self.o_proj) is nn.Linear and self._native_rows(x):  # not under tensor parallelism:
            # a row-parallel o_proj sums its ranks' partial outputs, which the C call would skip
            fused = attention_out(attn, self.o_proj.weight, x, norm.weight, norm.eps)
            if fused is not None:
                return fused
        delta = self.o_proj(attn)
        if x.is_cpu and not torch.compiler.is_compiling():  # a long step: the add and the norm in one C pass
            fused = add_rms_norm(x, delta, norm.weight, norm.eps)
            if fused is not None:
                return fused
        x = x + delta
        return x, norm(x)

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] of x's rows (``norm`` applied first when given,
        RoPE applied, v scaled), k and v stored at the batch's slots of this layer's pool. Alone, it is
        what an MTP extend needs of a layer whose output nothing reads (MTPLayer.write_kv)."""
        spec = self.spec
        t = x.shape[0]
        slots = batch.swa_slot_mapping if self.is_sliding else batch.full_slot_mapping
        qkv = self._native_front(x, batch, k_cache, v_cache, norm, slots)
        if qkv is not None:
            qk = qkv[:, : spec.q_size + spec.k_size].view(t, spec.num_heads + spec.num_kv_heads, spec.head_dim)
            v = qkv[:, spec.q_size + spec.k_size :].view(t, spec.num_kv_heads, spec.v_head_dim)
            return qk[:, : spec.num_heads], qk[:, spec.num_heads :], v
        glue = x.is_cpu and not torch.compiler.is_compiling()  # the long step's C glue (module doc) may serve
        normed = None if norm is None or not glue else add_rms_norm(x, None, norm.weight, norm.eps)
        qkv = self.qkv_proj(x if norm is None else norm(x) if normed is None else normed[1])
        # q and k heads share head_dim and sit side by side in the projection: rotate them together,
        # in place on the projection's output (no copies of q, k or v).
        qk = qkv[:, : spec.q_size + spec.k_size].view(t, spec.num_heads + spec.num_kv_heads, spec.head_dim)
        v = qkv[:, spec.q_size + spec.k_size :].view(t, spec.num_kv_heads, spec.v_head_dim)
        cos, sin = self._rotary_tables(batch, x.dtype)
        if glue and rope_store(qkv, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                               v_head_dim=spec.v_head_dim, cos=cos, signed_sin=sin, value_scale=self.value_scale,
                               k_cache=k_cache, v_cache=v_cache, slots=slots):
            return qk[:, : spec.num_heads], qk[:, spec.num_heads :], v
        if self.value_scale != 1.0:  # x * 1.0 == x: skipping the multiply is exact
            v.mul_(self.value_scale)
        self.rotary.apply_(qk, cos, sin)
        q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
        # the Triton store skips negative slots on the device: asking would only sync the host
        all_valid = batch.slots_all_valid or (not ops.use_triton(k_cache) and self._slots_valid(batch, slots))
        ops.store_kv(k_cache, v_cache, slots, k, v, all_valid=all_valid)
        return q, k, v

    def _native_front(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      norm: RMSNorm | None, slots: torch.Tensor) -> torch.Tensor | None:
        """The [T, N] projection from the C front (norm, QKV, RoPE, value scale, KV store in one call),
        or None where the torch path serves: more than MAX_ROWS rows, a compiled step (the C
        call would split its graph), bf16, CUDA or the kernels off."""
        if not self._native_rows(x):
            return None
        spec = self.spec
        cos, sin = self._rotary_tables(batch, x.dtype)
        return attention_front(x, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps,
                               self.qkv_proj.weight, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                               head_dim=spec.head_dim, v_head_dim=spec.v_head_dim, cos=cos, signed_sin=sin,
                               value_scale=self.value_scale, k_cache=k_cache, v_cache=v_cache, slots=slots)

    def _native_rows(self, x: torch.Tensor) -> bool:
        """Whether the C layer glue may serve x's rows (see _native_front). Any step of at most
        MAX_ROWS rows, decode or prefill: the glue does not depend on how attention runs, and a
        short prefill (a question after a prefix-cache hit) is the same few rows of GEMM, norm and
        RoPE as a decode batch. The calls themselves return None where they cannot serve (bf16,
        CUDA, kernels off)."""
        return x.shape[0] <= MAX_ROWS and x.is_cpu and not torch.compiler.is_compiling()

    def prime(self, batch: ForwardBatch, plan, rotary: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
              slots_valid: bool | None = None) -> None:
        """Give ``batch`` this layer's attention plan and rotary tables (and whether all its slots of
        this layer's pool are >= 0, when known), computed by the caller for several steps at once (MTP
        draft steps: ops.attention_decode_plans, one rotary.tables call, one slot check)."""
        batch.step_cache[("attn", self.is_sliding, self.window, dtype)] = plan
        batch.step_cache[("rope", self.rotary.rotary_dim, self.rotary.theta, dtype)] = rotary
        if slots_valid is not None:
            batch.step_cache[("slots_valid", self.is_sliding)] = slots_valid

    def _rotary_tables(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed-sin tables of this step, shared by the layers with the same rotary setup."""
        key = ("rope", self.rotary.rotary_dim, self.rotary.theta, dtype)
        hit = batch.step_cache.get(key)
        if hit is None:
            hit = batch.step_cache[key] = self.rotary.tables(batch.positions, dtype)
        return hit

    def _slots_valid(self, batch: ForwardBatch, slots: torch.Tensor) -> bool:
        """Whether every slot of this step's mapping for this layer's pool is >= 0: checked once per
        step and pool, not in every layer's KV store."""
        key = ("slots_valid", self.is_sliding)
        hit = batch.step_cache.get(key)
        if hit is None:
            hit = batch.step_cache[key] = bool((slots >= 0).all())
        return hit

    def _table(self, batch: ForwardBatch) -> torch.Tensor:
        """``batch``'s block table of this layer's pool."""
        return batch.swa_block_table if self.is_sliding else batch.full_block_table

    def _plan(self, batch: ForwardBatch, q: torch.Tensor):
        """The attention index plan of this step for this layer's pool and window (built once)."""
        key = ("attn", self.is_sliding, self.window, q.dtype)
        if key not in batch.step_cache:
            batch.step_cache[key] = ops.attention_plan(q, self._table(batch), batch.query_start_loc, batch.seq_lens,
                                                       page_size=batch.page_size, window=self.window,
                                                       head_dim=self.spec.head_dim)
        return batch.step_cache[key]

    def _rows_plan(self, batch: ForwardBatch, q: torch.Tensor, rows: torch.Tensor):
        """The plan of the logits rows ``rows`` as decode rows of ``batch.logits_batch()`` (built once):
        picked from this step's plan of the same pool when an earlier layer built one that holds them
        as kernel rows (``AttentionPlan.picked``), else built from that batch."""
        key = ("attn_rows", self.is_sliding, self.window, q.dtype)
        if key not in batch.step_cache:
            step = batch.step_cache.get(("attn", self.is_sliding, self.window, q.dtype))
            hit = None if step is None else step.picked(rows)
            if hit is None:
                hit = self._plan(batch.logits_batch(), q)
            batch.step_cache[key] = hit
        return batch.step_cache[key]

    def extra_repr(self) -> str:
        return f"window={self.window}, sinks={self.spec.has_sinks}, value_scale={self.value_scale}"
