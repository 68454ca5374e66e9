"""Tensor-parallel building blocks the model layers are made of (Megatron-style).

    column-parallel  y_local = x W[rows of this rank]^T        output split, no communication
    row-parallel     y = all_reduce( x_local W[:, cols of this rank]^T )   one all-reduce
    vocab-parallel   embedding: rows [v0, v1) of the table; ids outside give 0, all-reduce sums
                     LM head: logits of vocab [v0, v1), gathered into [T, V] on rank 0 for the sampler

A block (attention, MLP) is column-parallel in, row-parallel out, so it costs one all-reduce. With
``ParallelContext.single()`` the factories return plain ``nn.Linear`` / ``nn.Embedding`` with the full
shapes, so the one-process model is unchanged (same parameter names, same checkpoint mapping).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from llm_core.distributed.parallel_context import ParallelContext


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over this rank's input columns; the partial outputs are summed over tp ranks."""

    def __init__(self, local_in: int, out_features: int, ctx: ParallelContext) -> None:
        super().__init__(local_in, out_features, bias=False)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce_tp(F.linear(x, self.weight))


def column_linear(in_features: int, out_local: int) -> nn.Linear:
    """A column-parallel linear is a plain linear over this rank's output rows (the loader slices)."""
    return nn.Linear(in_features, out_local, bias=False)


def row_linear(in_local: int, out_features: int, ctx: ParallelContext) -> nn.Linear:
    """Plain ``nn.Linear`` in one process, :class:`RowParallelLinear` under tensor parallelism."""
    if ctx.tp_size == 1:
        return nn.Linear(in_local, out_features, bias=False)
    return RowParallelLinear(in_local, out_features, ctx)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + local) of the embedding; the sum over ranks is the lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext) -> None:
        self.vocab_start, vocab_stop = ctx.tp_range(vocab_size, "vocab_size")
        super().__init__(vocab_stop - self.vocab_start, hidden_size)
        self.ctx = ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)  # exactly one rank contributes each row: the sum is exact
        return self.ctx.all_reduce_tp(out)


def embedding(vocab_size: int, hidden_size: int, ctx: ParallelContext) -> nn.Embedding:
    if ctx.tp_size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, ctx)


def lm_head(hidden_size: int, vocab_size: int, ctx: ParallelContext) -> nn.Linear:
    """The LM head's rows for this rank's vocabulary slice (the model gathers the logits)."""
    v0, v1 = ctx.tp_range(vocab_size, "vocab_size")
    return nn.Linear(hidden_size, v1 - v0, bias=False)
