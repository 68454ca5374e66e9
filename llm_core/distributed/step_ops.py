"""What rank 0 tells the other ranks each time it calls the model: one small typed message per call,
broadcast over the control group (llm_core/distributed/step_mirror.py sends, worker.py obeys).

The message's tensors (ids, the batch's fields) travel on the CPU, pickled, and each rank moves them
to its own device (a CUDA tensor would pickle with rank 0's device index); a step's embeddings follow
the message on the model's group instead (``ForwardOp``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llm_core.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class LayoutOp:
    """Prepare the weights as rank 0's model runner does, once after loading: the C kernels on or off
    (rank 0's effective ``native_cpu_kernels``), the kernel layouts, and huge pages for the weights
    and the KV pool (``huge_pages``)."""

    native_cpu_kernels: bool
    huge_pages: bool


@dataclass(frozen=True)
class EmbedOp:
    """``model.embed(ids)`` (the multimodal path embeds text rows, then splices media rows)."""

    input_ids: torch.Tensor


class _BatchFields:
    """A message carrying a ForwardBatch as its fields (``batch``), rebuilt on each rank's device."""

    @staticmethod
    def batch_fields(fb: ForwardBatch) -> dict:
        """name -> (value on the CPU, whether it lived on the accelerator): some fields stay on the
        host by contract (query_start_loc, seq_lens) and must stay there on every rank."""
        return {f.name: (_cpu(v), isinstance(v, torch.Tensor) and v.device.type != "cpu")
                for f in dataclasses.fields(fb) if f.name != "step_cache" for v in [getattr(fb, f.name)]}

    def forward_batch(self, device: torch.device) -> ForwardBatch:
        return ForwardBatch(**{k: _to(v, device) if on_device else v for k, (v, on_device) in self.batch.items()})


def tensor_meta(t: torch.Tensor | None) -> tuple[tuple[int, ...], str] | None:
    """(shape, dtype name) of a tensor that follows a message as a broadcast (None: none follows)."""
    return None if t is None else (tuple(t.shape), str(t.dtype).removeprefix("torch."))


def empty_like_meta(meta: tuple[tuple[int, ...], str] | None, device: torch.device) -> torch.Tensor | None:
    """The buffer a worker receives a broadcast tensor of ``meta`` into."""
    if meta is None:
        return None
    shape, dtype = meta
    return torch.empty(shape, dtype=getattr(torch, dtype), device=device)


@dataclass(frozen=True)
class ForwardOp(_BatchFields):
    """``model(input_ids | inputs_embeds, batch, kv)``; ``kv_tokens`` = (Full, SWA) slots of rank 0's
    pools, which every rank's own pools match (the scheduler's page ids are valid on every rank).

    The embeddings (a step's spliced media rows: ~64 MB per 8k bf16 rows) are not in the message:
    ``embeds`` names their (shape, dtype) and rank 0 broadcasts them next on the model's group from
    its device (NCCL on GPUs), where pickling them would copy them to the host and through TCP."""

    batch: dict
    input_ids: torch.Tensor | None
    embeds: tuple[tuple[int, ...], str] | None
    kv_tokens: tuple[int, int]

    def empty_embeds(self, device: torch.device) -> torch.Tensor | None:
        """The buffer a worker receives the broadcast embeddings into."""
        return empty_like_meta(self.embeds, device)


@dataclass(frozen=True)
class MTPOp(_BatchFields):
    """MTP layer ``layer`` over ``batch`` (llm_core/model/mtp.py), its K/V in pool layer
    ``kv_layer``: the speculative draft's and extend's calls (llm_core/engine/speculative/). Its
    inputs follow the message as broadcasts on the model's group, as a ForwardOp's embeddings do: the
    previous level's hidden states (rank 0 keeps the tails), and the rows' embeddings -- unless
    ``input_ids`` are given (a draft step's tokens), which every rank embeds itself (one collective
    instead of an embedding call and a broadcast). ``write_only``: only the layer's K/V."""

    layer: int
    kv_layer: int
    write_only: bool
    batch: dict
    kv_tokens: tuple[int, int]
    embeds: tuple[tuple[int, ...], str] | None
    h_prev: tuple[tuple[int, ...], str]
    input_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class LogitsOp:
    """``model.compute_logits(batch.logits_hidden(hidden))`` of the last forward; with ``span``
    (start, stop): of its rows ``hidden[start:stop]`` instead (prompt logprobs, every row kept); with
    ``index``: of the rows ``hidden[index]`` (a speculative step's verify rows); ``mtp``: of the last
    MTP layer's output instead of the target's (a draft step's: every row, or ``index``)."""

    rows: int
    span: tuple[int, int] | None = None
    index: torch.Tensor | None = None
    mtp: bool = False


@dataclass(frozen=True)
class ReportOp:
    """Every rank reports its weight and KV bytes and its share (all_gather_object)."""


@dataclass(frozen=True)
class BudgetOp:
    """Every rank reports its default KV budget, ``memory_fraction`` of its own device's free memory
    (all_gather_object): rank 0 sizes the pools every rank allocates from the smallest."""

    memory_fraction: float


@dataclass(frozen=True)
class PoolOp:
    """Allocate this rank's share of the dual pool now, at start-up, with rank 0's page counts (an
    allocation that fails then stops the server from starting instead of failing its first request);
    every rank then reports back (all_gather_object), so rank 0 knows the pools exist."""

    kv_tokens: tuple[int, int]
    page_size: int
    extra_sliding: int = 0  # sliding layers past the model's own: the MTP layers' KV (speculative decoding)


@dataclass(frozen=True)
class GraphsOp:
    """Build this rank's fixed-shape decode steps (llm_core/engine/fixed_decode/decode_graphs.py)
    over its shard and KV share with rank 0's buckets, mode and scratch pages, and warm them up --
    capture them, on CUDA -- as rank 0 does, in the same order, so their collectives meet."""

    buckets: tuple[int, ...]
    mode: str
    max_model_len: int
    scratch: tuple[int, int]
    splits: dict  # (bucket, key width) -> key splits: rank 0's, so every rank captures the same graphs


@dataclass(frozen=True)
class FixedStepOp:
    """One fixed-shape decode step of ``bucket`` rows: rank 0's step inputs (``StepRows``), which
    every rank copies into its own graph's buffers before it replays it."""

    bucket: int
    rows: object  # llm_core.engine.fixed_decode.step_rows.StepRows


@dataclass(frozen=True)
class StopOp:
    """Leave the loop: the engine is closing."""


def _cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _to(x, device: torch.device):
    return x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x


def to_device(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if x is None else _to(x, device)


def to_cpu(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else _cpu(x)
