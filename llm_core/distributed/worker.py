"""A rank other than 0: join the group, load this rank's shard, then make every model call rank 0
makes (step_ops.py), on its own shard and its own share of the KV pools, until told to stop.

The worker keeps no scheduler: rank 0 decides each step and sends the batch (slot mappings and page
tables are the same on every rank, since every rank's pools have the same pages, only fewer heads).

A call that fails here is not retried and not hidden: rank 0 is then waiting in a collective this
rank will never make, so the worker logs the error with its traceback and exits 1; rank 0 sees the
closed connection or the exit code and raises RankFailure naming this rank.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from kernels.cpu import huge_pages as huge_page_memory
from kernels import native
from llm_core.distributed.rank_group import LaunchSpec, RankGroup, torchrun_rank
from llm_core.distributed.step_ops import (BudgetOp, EmbedOp, FixedStepOp, ForwardOp, GraphsOp, LayoutOp, LogitsOp,
                                           MTPOp, PoolOp, ReportOp, StopOp, empty_like_meta, to_device)
from llm_core.kvcache.dual_pool import DualKVPool, default_kv_budget_bytes
from llm_core.model.dtype import parse_dtype
from llm_core.model.mtp import mtp_kv_layout

log = logging.getLogger("mmserve.rank")


def share_report(rank: int, model, pool: DualKVPool | None) -> dict:
    """This rank's weight bytes, KV bytes and share, and how its weights were prepared (what tests
    and start-up logs check)."""
    params = list({id(p): p for p in model.parameters()}.values())
    # block-FP8 experts' factors are buffers (kernels/block_fp8.py): weights too, by the bytes they take
    scales = [b for n, b in model.named_buffers() if n.endswith("_scale_inv")]
    kv = 0 if pool is None else pool.full_bytes + pool.swa_bytes
    moe = [m for m in model.modules() if hasattr(m, "placement")]
    experts = (moe[0].placement.lo, moe[0].placement.hi) if moe else None
    layout = model.kv_layout()
    return {"rank": rank, "weight_bytes": sum(t.numel() * t.element_size() for t in params + scales), "kv_bytes": kv,
            "experts": experts, "kv_heads": (layout.full.num_kv_heads, layout.sliding.num_kv_heads),
            "native_cpu_kernels": native.enabled(),
            # weights re-laid column-major by use_kernel_layouts_ (the same count on every rank)
            "relaid_weights": sum(1 for p in params if p.dim() >= 2 and not p.is_contiguous())}


def worker_main(rank: int, spec: LaunchSpec) -> None:
    """Process entry of ranks 1..W-1 (spawned by RankGroup.start). An error while joining the group
    ends the process with its traceback (exit 1), which rank 0 watches for during the rendezvous."""
    if not logging.getLogger().handlers:  # a spawned process has no logging set up: errors must show
        logging.basicConfig(format=f"%(asctime)s mmserve rank {rank} %(levelname)s %(message)s")
    if torchrun_rank() is None:  # spawned by rank 0 (torchrun's agent watches its own ranks)
        exit_with_parent()
    torch.set_num_threads(spec.threads)
    group = RankGroup(spec, rank)
    code = 1
    try:
        model, error = None, None
        try:
            from llm_core.model.loader import load_model

            model = load_model(spec.model_dir, device=group.device, dtype=parse_dtype(spec.dtype), parallel=group.ctx,
                               fp8_experts=spec.fp8_experts, load_mtp=spec.load_mtp)
        except Exception as exc:  # noqa: BLE001 -- told to every rank in the handshake below
            log.error("loading this rank's shard failed", exc_info=True)
            error = f"{type(exc).__name__}: {exc}"
        errors = group.ready(error)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None and r != rank]
        if failed:
            log.error("leaving: another rank failed to load (%s)", "; ".join(failed))
        elif model is not None:
            code = serve_steps(model, group)
            if code:
                # rank 0 sits in a collective with this rank: exit now, so that the exit code (which
                # names this rank there) follows the closed connection at once, not after a teardown
                for handler in logging.getLogger().handlers:
                    handler.flush()
                sys.stderr.flush()
                os._exit(code)
    except Exception:  # noqa: BLE001 -- rank 0 (or the group) is gone: nothing to serve
        log.error("lost rank 0, exiting", exc_info=True)
    finally:
        group.close()
    sys.exit(code)


def exit_with_parent(poll_s: float = 1.0) -> threading.Thread:
    """End this process when the one that spawned it (rank 0) is gone, killed without a chance to
    stop its ranks: on gloo the next collective would fail, but a rank inside an NCCL collective
    waits for NCCL's watchdog (distributed_timeout_s, ten minutes by default) holding its GPU.
    A thread polling the parent pid is enough (an orphan is re-parented); the exit skips cleanup,
    since the group it would tear down is already broken."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                log.error("rank 0 (pid %d) is gone; exiting", parent)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(1)

    thread = threading.Thread(target=watch, name="mmserve-parent-watch", daemon=True)
    thread.start()
    return thread


def serve_steps(model, group: RankGroup) -> int:
    """Obey rank 0's messages until StopOp (0), or until a call fails here (1, after logging it)."""
    pool: DualKVPool | None = None
    graphs = None  # fixed-shape decode steps (GraphsOp), rank 0's buckets over this rank's share
    hidden, batch = None, None
    mtp_out = None  # the last MTP layer call's output (a draft step's logits read it)
    huge_pages = False
    extra_sliding = 0  # the MTP layers' KV layers past the model's own (PoolOp)
    while True:
        op = group.receive()
        if isinstance(op, StopOp):
            if graphs is not None:  # before the group's teardown (DecodeGraphs.release)
                graphs.release()
            return 0
        try:
            with torch.inference_mode():
                if isinstance(op, ReportOp):
                    group.gather_objects(share_report(group.rank, model, pool))
                elif isinstance(op, BudgetOp):
                    group.gather_objects(default_kv_budget_bytes(group.device, op.memory_fraction))
                elif isinstance(op, PoolOp):
                    extra_sliding = op.extra_sliding
                    pool = _pool(pool, model, op.kv_tokens, op.page_size, group.device, huge_pages, extra_sliding)
                    group.gather_objects(None)
                elif isinstance(op, GraphsOp):
                    from llm_core.engine.fixed_decode.decode_graphs import DecodeGraphs

                    graphs = DecodeGraphs(model, pool, buckets=op.buckets, mode=op.mode,
                                          max_model_len=op.max_model_len, scratch=op.scratch,
                                          agree=group.all_agree, splits=op.splits)
                    graphs.warm_up(pool)
                elif isinstance(op, FixedStepOp):
                    graphs.step_rows(op.bucket, op.rows, pool)
                elif isinstance(op, LayoutOp):
                    huge_pages = op.huge_pages
                    prepare_weights(model, op, group.device)
                elif isinstance(op, EmbedOp):
                    model.embed(to_device(op.input_ids, group.device))
                elif isinstance(op, ForwardOp):
                    batch = op.forward_batch(group.device)
                    pool = _pool(pool, model, op.kv_tokens, batch.page_size, group.device, huge_pages, extra_sliding)
                    hidden = None
                    embeds = op.empty_embeds(group.device)
                    if embeds is not None:  # rank 0 broadcasts them right after the message
                        model.parallel.broadcast_from_first(embeds)
                    hidden = model(to_device(op.input_ids, group.device), batch, pool, inputs_embeds=embeds)
                elif isinstance(op, MTPOp):
                    mtp_out = _mtp_layer(model, op, pool, group)
                elif isinstance(op, LogitsOp):
                    src = mtp_out if op.mtp else hidden  # a draft step's rows, or the target's
                    rows = (src[to_device(op.index, group.device)] if op.index is not None
                            else src[op.span[0]:op.span[1]] if op.span is not None
                            else src if op.mtp else batch.logits_hidden(hidden))
                    if rows.shape[0] != op.rows:
                        raise RuntimeError(f"rank {group.rank}: {rows.shape[0]} logits rows, rank 0 asked {op.rows}")
                    model.compute_logits(rows)
                else:
                    raise TypeError(f"unknown message {type(op).__name__}")
        except Exception:  # noqa: BLE001 -- rank 0 waits in a collective this rank will not make
            log.error("%s failed; leaving the group so that rank 0 stops waiting", type(op).__name__, exc_info=True)
            return 1


def prepare_weights(model, op: LayoutOp, device: torch.device) -> None:
    """What LLMEngine and ModelRunner do on rank 0 after loading, with rank 0's settings."""
    native.set_enabled(op.native_cpu_kernels)  # before the re-layout, as on rank 0
    model.use_kernel_layouts_()
    if op.huge_pages:
        huge_page_memory.move_module_(model)
    if device.type == "cpu" and model.model.norm.weight.dtype == torch.float32 and native.enabled():
        native.build_all()  # now, not in the first step (rank 0's collectives would wait for the compile)


def _mtp_layer(model, op: MTPOp, pool: DualKVPool, group: RankGroup) -> torch.Tensor | None:
    """Rank 0's MTP layer call (MirroredModel.mtp_layer) over this rank's shard and KV share."""
    batch = op.forward_batch(group.device)
    if op.input_ids is not None:  # a draft step's tokens: every rank embeds them (one collective)
        embeds = model.embed(to_device(op.input_ids, group.device))
    else:  # rank 0 broadcasts them right after the message, then h_prev
        embeds = empty_like_meta(op.embeds, group.device)
        model.parallel.broadcast_from_first(embeds)
    h_prev = empty_like_meta(op.h_prev, group.device)
    model.parallel.broadcast_from_first(h_prev)
    layer = model.model.mtp.layers[op.layer]
    k_cache, v_cache = pool.layer(op.kv_layer)
    if op.write_only:
        return layer.write_kv(embeds, h_prev, batch, k_cache, v_cache)
    return layer(embeds, h_prev, batch, k_cache, v_cache)


def _pool(pool, model, kv_tokens: tuple[int, int], page_size: int, device, huge_pages: bool,
          extra_sliding: int = 0) -> DualKVPool:
    """This rank's share of the dual pool, with rank 0's page counts (allocated once: at start-up by
    PoolOp; a ForwardOp's counts only ever match it, the check keeps a worker right if they did not)
    and ``extra_sliding`` sliding layers past the model's own (the MTP layers' KV, as rank 0's)."""
    full, swa = kv_tokens
    if pool is not None and (pool.full.num_pages * page_size, pool.swa.num_pages * page_size) == (full, swa):
        return pool
    dtype = model.model.norm.weight.dtype
    layout = mtp_kv_layout(model.kv_layout(), extra_sliding, model.config.sliding_window)
    return DualKVPool(layout, num_full_tokens=full, num_swa_tokens=swa, page_size=page_size,
                      dtype=dtype, device=device, huge_pages=huge_pages)
