"""MirroredModel: rank 0's model under tensor / expert parallelism.

It looks like the one-process model to the engine (``config``, ``embed``, ``__call__``,
``compute_logits``, ``kv_layout``, parameters: everything else is the local shard's), and each call
first tells the other ranks to make the same call (step_ops.py) so that their collectives meet:

    rank 0 (engine, scheduler, sampler)            ranks 1..W-1 (worker.py)
    runner.forward ─► MirroredModel.__call__ ─send ForwardOp─► model(batch, own KV share)
                       local shard forward  ◄──── all-reduce per block, logits gathered to rank 0 ►
    sampler on the gathered fp32 logits (rank 0 only)

So one scheduler decides for all ranks and the step is broadcast; the engine and runner are unchanged.

Failure: once a message is out, the other ranks are inside that call; if rank 0's half then raises,
rank 0 cannot tell which collective each rank waits in, so any exception there is the group's
failure (RankFailure; a KeyboardInterrupt stays one) and the group is not used again. Checks that
fail one request's input (a token id outside the vocabulary, inputs of the wrong shape) therefore
run here, before the message, and fail only that request.
"""

from __future__ import annotations

import atexit
from typing import Any, Callable

import torch

from kernels.cpu import huge_pages as huge_page_memory
from kernels import native
from llm_core.distributed.rank_failure import RankFailure
from llm_core.distributed.rank_group import RankGroup
from llm_core.distributed.step_ops import (BudgetOp, EmbedOp, FixedStepOp, ForwardOp, GraphsOp, LayoutOp, LogitsOp,
                                           MTPOp, PoolOp, ReportOp, tensor_meta, to_cpu)
from llm_core.distributed.worker import share_report
from llm_core.kvcache.dual_pool import default_kv_budget_bytes


class MirroredModel:
    """Rank 0's shard plus the group it mirrors its calls to; ``close()`` stops the other ranks."""

    def __init__(self, local: torch.nn.Module, group: RankGroup) -> None:
        self.local = local
        self.group = group

    def __getattr__(self, name: str):
        # config, model, parameters(), kv_layout(), parallel ...: the local shard answers
        return getattr(self.__dict__["local"], name)

    def prepare_weights_(self, huge_pages: bool) -> None:
        """The model runner's one-time preparation after loading, on every rank with rank 0's
        settings: the C kernels' switch (set by the engine just before), the kernel layouts, huge pages."""
        def local() -> None:
            self.local.use_kernel_layouts_()
            if huge_pages:
                huge_page_memory.move_module_(self.local)

        self._mirror(LayoutOp(native.enabled(), huge_pages), "weight preparation", local)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        _check_ids(input_ids, self.local.config.vocab_size)
        return self._mirror(EmbedOp(to_cpu(input_ids)), "embed", self.local.embed, input_ids)

    def __call__(self, input_ids, batch, kv, inputs_embeds=None) -> torch.Tensor:
        config = self.local.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            _check_ids(input_ids, config.vocab_size)
        shape = (*input_ids.shape, config.hidden_size) if input_ids is not None else tuple(inputs_embeds.shape)
        if shape != (batch.num_tokens, config.hidden_size):  # the model's own check, as the ids' embedding
            raise ValueError(f"inputs have shape {shape}; expected [{batch.num_tokens}, {config.hidden_size}]")
        op = ForwardOp(ForwardOp.batch_fields(batch), to_cpu(input_ids), tensor_meta(inputs_embeds),
                       _kv_tokens(kv, config.layer_kinds))

        def forward() -> torch.Tensor:
            if inputs_embeds is not None:  # to the workers from this device, right after the message
                self.local.parallel.broadcast_from_first(inputs_embeds.contiguous())
            return self.local(input_ids, batch, kv, inputs_embeds=inputs_embeds)

        return self._mirror(op, "forward", forward)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._mirror(LogitsOp(int(hidden.shape[0])), "logits", self.local.compute_logits, hidden)

    def compute_logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``compute_logits(hidden[rows])`` of the last forward's output (a speculative step's verify
        rows and plain rows): every rank takes the same rows of its own."""
        index = torch.tensor(rows, dtype=torch.long)
        return self._mirror(LogitsOp(len(rows), index=index), "logits", self.local.compute_logits,
                            hidden[index.to(hidden.device, non_blocking=True)])

    def mtp_layer(self, layer: int, kv_layer: int, embeds: torch.Tensor | None, h_prev: torch.Tensor, batch, kv,
                  write_only: bool = False, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """MTP layer ``layer`` on every rank (``MTPLayer.forward``, or ``write_kv`` when
        ``write_only``), its K/V in pool layer ``kv_layer`` of each rank's share: the message, then
        its inputs broadcast from this device (the proposer keeps its tails on rank 0). Exactly one of
        ``embeds`` and ``input_ids`` (a draft step's tokens, which every rank embeds itself)."""
        if (embeds is None) == (input_ids is None):
            raise ValueError("give exactly one of embeds and input_ids")
        if input_ids is not None:
            _check_ids(input_ids, self.local.config.vocab_size)
        dtype = self.local.model.embed_tokens.weight.dtype
        h_prev = h_prev if h_prev.dtype == dtype else h_prev.to(dtype)
        op = MTPOp(layer, kv_layer, write_only, MTPOp.batch_fields(batch), _kv_tokens(kv, self.local.config.layer_kinds),
                   tensor_meta(embeds), tensor_meta(h_prev), to_cpu(input_ids))

        def run() -> torch.Tensor | None:
            nonlocal embeds
            if embeds is None:
                embeds = self.local.embed(input_ids)
            else:
                self.local.parallel.broadcast_from_first(embeds.contiguous())
            self.local.parallel.broadcast_from_first(h_prev.contiguous())
            mtp = self.local.model.mtp.layers[layer]
            k_cache, v_cache = kv.layer(kv_layer)
            if write_only:
                return mtp.write_kv(embeds, h_prev, batch, k_cache, v_cache)
            return mtp(embeds, h_prev, batch, k_cache, v_cache)

        return self._mirror(op, "MTP layer", run)

    def mtp_logits(self, out: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``compute_logits`` of the last ``mtp_layer`` output's ``rows`` (all when None: a draft
        step's rows; a chain step's last row of each request)."""
        if rows is None:
            return self._mirror(LogitsOp(int(out.shape[0]), mtp=True), "logits", self.local.compute_logits, out)
        index = rows.detach().cpu()
        return self._mirror(LogitsOp(len(index), index=index, mtp=True), "logits", self.local.compute_logits,
                            out[rows])

    def compute_logits_rows(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``compute_logits(hidden[start:stop])`` of the last forward's every-row output: every rank
        takes the same rows of its own."""
        return self._mirror(LogitsOp(stop - start, (start, stop)), "logits", self.local.compute_logits,
                            hidden[start:stop])

    def mirrored_decode_graphs(self, pool, *, buckets: tuple[int, ...], mode: str, max_model_len: int):
        """Fixed-shape decode steps on every rank (DecodeGraphs over each rank's shard and KV share):
        rank 0's are built over its local shard, the others build theirs from a GraphsOp, and all warm
        up -- capture, on CUDA -- in the same order. Each step then goes out as a FixedStepOp with its
        input rows, and every rank replays its own graph of that bucket, whose collectives meet."""
        from llm_core.engine.fixed_decode.decode_graphs import DecodeGraphs
        from llm_core.engine.fixed_decode.step_rows import StepRows

        if mode == "compile":
            raise ValueError("torch.compile'd decode steps are not mirrored across tensor/expert-parallel ranks "
                             "(CUDA graphs and the eager fixed-shape steps are)")

        def mirror(bucket: int, rows, run):
            return self._mirror(FixedStepOp(bucket, StepRows.of(rows, bucket)), "decode step", run)

        graphs = DecodeGraphs(self.local, pool, buckets=buckets, mode=mode, max_model_len=max_model_len, mirror=mirror,
                              agree=self.group.all_agree)
        self._graphs = graphs  # released before the group closes (close; at exit before the group's handler)
        atexit.register(graphs.release)
        self._mirror(GraphsOp(graphs.buckets, mode, max_model_len, graphs.scratch, graphs.split_table()),
                     "decode graphs", graphs.warm_up, pool)
        return graphs

    def greedy_ids(self, hidden: torch.Tensor) -> None:
        """Never: every rank runs ``compute_logits`` with rank 0, so the runner takes that path."""
        return None

    def reports(self, pool) -> list[dict]:
        """Every rank's weight / KV bytes and share, rank 0's from ``pool`` (the engine's pools)."""
        return self._mirror(ReportOp(), "reports", self.group.gather_objects, share_report(0, self.local, pool))

    def kv_budget_bytes(self, device: torch.device, memory_fraction: float) -> int:
        """The default KV budget of the group: every rank allocates pools of rank 0's page counts
        (``ForwardOp.kv_tokens``), so they are sized from the rank with the least free memory -- a
        GPU shared with another process would otherwise run out of memory inside a step."""
        budgets = self._mirror(BudgetOp(memory_fraction), "KV budget", self.group.gather_objects,
                               default_kv_budget_bytes(device, memory_fraction))
        return min(budgets)

    def allocate_kv(self, pool) -> None:
        """The other ranks allocate their share of ``pool`` (rank 0's) now, not in the first request:
        a rank that cannot stops the engine from starting, named (it exits; rank 0's gather fails).
        Their layouts take the layers rank 0's pool has past the model's (the MTP layers' KV)."""
        extra = len(pool.layout.layer_kinds) - self.local.config.num_layers
        self._mirror(PoolOp(_kv_tokens(pool, self.local.config.layer_kinds), pool.page_size, extra), "KV pools",
                     self.group.gather_objects, None)

    def check_health(self) -> None:
        """Raise RankFailure when a spawned rank has exited or the ranks are out of step (cheap: exit
        codes only; an idle server calls it between steps, so a death is noticed without a request)."""
        dead = self.group.dead_rank()
        if dead is not None:
            raise RankFailure(f"tensor/expert-parallel {dead}")
        if self.group.broken is not None:
            raise RankFailure(f"tensor/expert-parallel ranks out of step since {self.group.broken}")

    def close(self) -> None:
        graphs = self.__dict__.pop("_graphs", None)
        if graphs is not None:  # before NCCL's teardown, which waits for graphs holding its collectives
            graphs.release()
        self.group.close()

    def _mirror(self, op: object, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Send ``op``, then make rank 0's half of the call."""
        self.group.send(op)
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:
            raise self.group.failure(what, exc) from exc
        except BaseException as exc:  # Ctrl-C mid-call: still itself, and the group stays broken
            self.group.broken = f"{type(exc).__name__} during {what}"
            raise
        if isinstance(op, (EmbedOp, ForwardOp, MTPOp, LogitsOp, FixedStepOp, GraphsOp)):  # calls with NCCL collectives
            self.group.device_done(what)
        self.group.settle()
        return out


def _check_ids(input_ids: torch.Tensor, vocab: int) -> None:
    """The model's vocabulary check (MiMoV2ForCausalLM.embed), made before any rank starts the call."""
    lo, hi = torch.aminmax(input_ids) if input_ids.numel() else (0, 0)
    if int(lo) < 0 or int(hi) >= vocab:
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab)][0].item()
        raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab})")


def _kv_tokens(kv, layer_kinds: tuple[str, ...]) -> tuple[int, int]:
    """(Full, SWA) slots of rank 0's pools, read off the first layer of each kind."""
    sizes = {}
    for i, kind in enumerate(layer_kinds):
        if kind not in sizes:
            sizes[kind] = int(kv.layer(i)[0].shape[0])
    return sizes.get("full", 0), sizes.get("sliding", 0)
