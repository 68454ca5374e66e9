"""A rank other than 0: join the group, load this rank's shard, then make every model call rank 0
makes (step_ops.py), on its own shard and its own share of the KV pools, until told to stop.

The worker keeps no scheduler: rank 0 decides each step and sends the batch (slot mappings and page
tables are the same on every rank, since every rank's pools have the same pages, only fewer heads).
"""

from __future__ import annotations

import logging
import sys

import torch

from llm_core.distributed.rank_group import LaunchSpec, RankGroup
from llm_core.distributed.step_ops import EmbedOp, ForwardOp, LogitsOp, ReportOp, StopOp, to_device
from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.model.dtype import parse_dtype

log = logging.getLogger("mmserve.rank")


def share_report(rank: int, model, pool: DualKVPool | None) -> dict:
    """This rank's weight bytes, KV bytes and share (what tests and start-up logs check)."""
    params = {id(p): p for p in model.parameters()}.values()
    kv = 0 if pool is None else pool.full_bytes + pool.swa_bytes
    moe = [m for m in model.modules() if hasattr(m, "placement")]
    experts = (moe[0].placement.lo, moe[0].placement.hi) if moe else None
    layout = model.kv_layout()
    return {"rank": rank, "weight_bytes": sum(p.numel() * p.element_size() for p in params), "kv_bytes": kv,
            "experts": experts, "kv_heads": (layout.full.num_kv_heads, layout.sliding.num_kv_heads)}


def worker_main(rank: int, spec: LaunchSpec) -> None:
    """Process entry of ranks 1..W-1 (spawned by RankGroup.start)."""
    torch.set_num_threads(spec.threads)
    group = RankGroup(spec, rank)
    code = 0
    try:
        from llm_core.model.loader import load_model

        model = load_model(spec.model_dir, device=group.device, dtype=parse_dtype(spec.dtype), parallel=group.ctx)
    except Exception as exc:  # noqa: BLE001 -- loading failed: say so; rank 0 sees the exit code
        print(f"mmserve rank {rank}: loading failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        group.processes = []
        group.close()
        sys.exit(1)
    try:
        group.ready("loading")
        serve_steps(model, group)
    except Exception as exc:  # noqa: BLE001 -- rank 0 (or the group) is gone: nothing to serve
        print(f"mmserve rank {rank}: lost rank 0, exiting: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        group.processes = []
        group.close()
    sys.exit(code)


def serve_steps(model, group: RankGroup) -> None:
    """Obey rank 0's messages until StopOp."""
    pool: DualKVPool | None = None
    hidden, batch = None, None
    while True:
        op = group.receive()
        if isinstance(op, StopOp):
            return
        if isinstance(op, ReportOp):
            group.gather_reports(share_report(group.rank, model, pool))
            continue
        try:
            with torch.inference_mode():
                if isinstance(op, EmbedOp):
                    model.embed(to_device(op.input_ids, group.device))
                elif isinstance(op, ForwardOp):
                    batch = op.forward_batch(group.device)
                    pool = _pool(pool, model, op.kv_tokens, batch.page_size, group.device)
                    hidden = None
                    hidden = model(to_device(op.input_ids, group.device), batch, pool,
                                   inputs_embeds=to_device(op.inputs_embeds, group.device))
                elif isinstance(op, LogitsOp):
                    rows = batch.logits_hidden(hidden)
                    if rows.shape[0] != op.rows:
                        raise RuntimeError(f"rank {group.rank}: {rows.shape[0]} logits rows, rank 0 asked {op.rows}")
                    model.compute_logits(rows)
                else:
                    raise TypeError(f"unknown message {type(op).__name__}")
        except Exception as exc:  # noqa: BLE001 -- rank 0 meets the same error on the same inputs
            log.debug("rank %d: %s failed: %s", group.rank, type(op).__name__, exc)


def _pool(pool, model, kv_tokens: tuple[int, int], page_size: int, device) -> DualKVPool:
    """This rank's share of the dual pool, with rank 0's page counts (allocated once)."""
    full, swa = kv_tokens
    if pool is not None and (pool.full.num_pages * page_size, pool.swa.num_pages * page_size) == (full, swa):
        return pool
    dtype = model.model.norm.weight.dtype
    return DualKVPool(model.kv_layout(), num_full_tokens=full, num_swa_tokens=swa, page_size=page_size,
                      dtype=dtype, device=device)
