"""ParallelContext: which share of the model one rank holds, and the collectives between the shares.

World of W = max(tp, ep) ranks (tp and ep are each 1 or a divisor-compatible size, see below):

    attention, dense MLP, embedding, LM head   tensor-parallel over tp ranks (tp = 1: replicated)
    MoE experts                                expert-parallel over ep groups of W / ep ranks each;
                                               inside a group the experts' intermediate dim is split
                                               (moe_tp = W / ep), so every rank holds E/ep experts x
                                               I/moe_tp columns and the world all-reduce sums them

    W = 2, tp = 2, ep = 1:  rank r: heads r/2, vocab r/2, every expert's I split in halves
    W = 2, tp = 1, ep = 2:  rank r: all heads (replicated attention and KV), experts [r*E/2, (r+1)*E/2)
    W = 2, tp = 2, ep = 2:  rank r: heads r/2, vocab r/2, experts [r*E/2, (r+1)*E/2) whole

Tokens are the same on every rank (attention output is all-reduced, or computed whole), so the MoE
needs no token dispatch: each rank runs its experts on the tokens routed to them and the world
all-reduce is the combine (docs/parallelism.md explains why this beats all-to-all here).

Heads per rank, per attention kind (q heads Hq, KV heads Hkv, tp ranks):

    q heads:  Hq / tp each, contiguous                       (tp must divide Hq)
    KV heads: tp <= Hkv: Hkv / tp each, contiguous            (tp must divide Hkv)
              tp >  Hkv: 1 each, replicated: rank r holds KV head r // (tp / Hkv)
    so every rank's q heads use only its own KV heads (GQA groups never straddle ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llm_core.model.config import AttentionSpec


class ParallelSplitError(ValueError):
    """A model dimension (vocabulary, heads, an intermediate size) that does not split evenly over
    the ranks: the parallel sizes asked for do not fit this checkpoint."""


@dataclass(frozen=True)
class HeadShard:
    """One rank's heads of one attention kind: q heads [q_start, q_start + num_heads), KV heads
    [kv_start, kv_start + num_kv_heads), and the local spec the layer is built with."""

    q_start: int
    kv_start: int
    local: AttentionSpec


@dataclass(frozen=True)
class ParallelContext:
    """One rank's place in a tensor-/expert-parallel world. ``single()`` is the one-process case;
    every collective is then the identity, so layers call them unconditionally."""

    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0
    group: object | None = None  # torch.distributed process group of the whole world (None: one process)

    def __post_init__(self) -> None:
        world = self.world_size
        if self.tp_size < 1 or self.ep_size < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={self.tp_size} ep={self.ep_size}")
        if self.tp_size not in (1, world):
            raise ValueError(f"tensor_parallel_size {self.tp_size} with expert_parallel_size {self.ep_size}: "
                             f"tp must be 1 or the world size {world}")
        if world % self.ep_size:
            raise ValueError(f"expert_parallel_size {self.ep_size} must divide the world size {world}")
        if not 0 <= self.rank < world:
            raise ValueError(f"rank {self.rank} outside the world of {world}")

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls()

    # ---- geometry ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp_size > 1 else 0

    @property
    def moe_tp_size(self) -> int:
        """Ranks sharing one expert group, each with a slice of the experts' intermediate dim."""
        return self.world_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    def split(self, n: int, parts: int, index: int, what: str) -> tuple[int, int]:
        """[start, stop) of part ``index`` of ``n`` items in ``parts`` equal contiguous parts."""
        if n % parts:
            raise ParallelSplitError(f"{what}: {n} does not split into {parts} equal parts")
        size = n // parts
        return index * size, (index + 1) * size

    def tp_range(self, n: int, what: str) -> tuple[int, int]:
        return self.split(n, self.tp_size, self.tp_rank, what)

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        return self.split(num_experts, self.ep_size, self.ep_rank, "experts")

    def moe_inter_range(self, inter: int) -> tuple[int, int]:
        return self.split(inter, self.moe_tp_size, self.moe_tp_rank, "moe_intermediate_size")

    def heads(self, spec: AttentionSpec, kind: str) -> HeadShard:
        tp, r = self.tp_size, self.tp_rank
        q0, q1 = self.split(spec.num_heads, tp, r, f"{kind} attention q heads")
        if tp <= spec.num_kv_heads:
            kv0, kv1 = self.split(spec.num_kv_heads, tp, r, f"{kind} attention KV heads")
        elif tp % spec.num_kv_heads:
            raise ValueError(f"{kind} attention: {spec.num_kv_heads} KV heads cannot be replicated evenly over "
                             f"{tp} ranks (tp must divide or be a multiple of the KV head count)")
        else:
            kv0 = r // (tp // spec.num_kv_heads)
            kv1 = kv0 + 1
        return HeadShard(q0, kv0, replace(spec, num_heads=q1 - q0, num_kv_heads=kv1 - kv0))

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the tp ranks' partial results (in place); identity without tensor parallelism."""
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_moe(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's expert partials (the expert-parallel combine)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place; the others pass a buffer of its shape and dtype)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src=0, group=self.group)
        return x

    def gather_tp_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """The tp ranks' slices concatenated along the last dim on rank 0, None on the others
        (vocab-parallel logits: only rank 0 samples, so a gather, not an all-gather -- the other
        ranks neither receive nor hold the [R, V] fp32 logits of a step)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        # tp spans the world (tp between 1 and W is refused), so tp rank 0 is global rank 0
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        return None if parts is None else torch.cat(parts, dim=-1)
