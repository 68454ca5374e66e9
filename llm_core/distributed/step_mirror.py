"""MirroredModel: rank 0's model under tensor / expert parallelism.

It looks like the one-process model to the engine (``config``, ``embed``, ``__call__``,
``compute_logits``, ``kv_layout``, parameters: everything else is the local shard's), and each call
first tells the other ranks to make the same call (step_ops.py) so that their collectives meet:

    rank 0 (engine, scheduler, sampler)            ranks 1..W-1 (worker.py)
    runner.forward ─► MirroredModel.__call__ ─send ForwardOp─► model(batch, own KV share)
                       local shard forward  ◄──── all-reduce per block, all-gather of logits ────►
    sampler on the gathered fp32 logits (rank 0 only)

So one scheduler decides for all ranks and the step is broadcast; the engine and runner are unchanged.
"""

from __future__ import annotations

import torch

from llm_core.distributed.rank_failure import RankFailure
from llm_core.distributed.rank_group import RankGroup
from llm_core.distributed.step_ops import EmbedOp, ForwardOp, LogitsOp, ReportOp, to_cpu
from llm_core.distributed.worker import share_report


class MirroredModel:
    """Rank 0's shard plus the group it mirrors its calls to; ``close()`` stops the other ranks."""

    def __init__(self, local: torch.nn.Module, group: RankGroup) -> None:
        self.local = local
        self.group = group

    def __getattr__(self, name: str):
        # config, model, parameters(), kv_layout(), parallel ...: the local shard answers
        return getattr(self.__dict__["local"], name)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.group.send(EmbedOp(to_cpu(input_ids)))
        return self._run("embed", self.local.embed, input_ids)

    def __call__(self, input_ids, batch, kv, inputs_embeds=None) -> torch.Tensor:
        self.group.send(ForwardOp(ForwardOp.batch_fields(batch), to_cpu(input_ids), to_cpu(inputs_embeds),
                                  _kv_tokens(kv, self.local.config.layer_kinds)))
        return self._run("forward", self.local, input_ids, batch, kv, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.send(LogitsOp(int(hidden.shape[0])))
        return self._run("logits", self.local.compute_logits, hidden)

    def greedy_ids(self, hidden: torch.Tensor) -> None:
        """Never: every rank runs ``compute_logits`` with rank 0, so the runner takes that path."""
        return None

    def reports(self, pool) -> list[dict]:
        """Every rank's weight / KV bytes and share, rank 0's from ``pool`` (the engine's pools)."""
        self.group.send(ReportOp())
        return self.group.gather_reports(share_report(0, self.local, pool))

    def check_health(self) -> None:
        """Raise RankFailure when a spawned rank has exited (cheap: exit codes only; an idle server
        calls it between steps, so a death is noticed without a request)."""
        dead = self.group.dead_rank()
        if dead is not None:
            raise RankFailure(f"tensor/expert-parallel {dead}")

    def close(self) -> None:
        self.group.close()

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            # A dead rank makes any collective fail: that is the group's failure, not the request's.
            # Other errors (e.g. a bad input) hit every rank alike before any collective.
            if self.group.dead_rank() is not None or _is_collective_error(exc):
                raise self.group.failure(what, exc) from exc
            raise


def _is_collective_error(exc: Exception) -> bool:
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(exc, (RankFailure, dist_error)) or "gloo" in str(exc).lower() or "nccl" in str(exc).lower()


def _kv_tokens(kv, layer_kinds: tuple[str, ...]) -> tuple[int, int]:
    """(Full, SWA) slots of rank 0's pools, read off the first layer of each kind."""
    sizes = {}
    for i, kind in enumerate(layer_kinds):
        if kind not in sizes:
            sizes[kind] = int(kv.layer(i)[0].shape[0])
    return sizes.get("full", 0), sizes.get("sliding", 0)
