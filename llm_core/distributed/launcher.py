"""load_text_model: the one entry point that gives the engine its model -- the whole model in this
process, or, with ``tensor_parallel_size`` / ``expert_parallel_size`` > 1, rank 0's shard mirrored
to the other ranks (spawned here, or started by torchrun).

Under torchrun every process runs the same program: rank 0 returns from here and serves; the other
ranks never return -- they obey rank 0 until it closes the engine, then exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from llm_core.distributed.rank_failure import RankFailure
from llm_core.distributed.rank_group import LaunchSpec, RankGroup, free_port, torchrun_rank


def load_text_model(model_dir: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | str = torch.float32, tensor_parallel_size: int = 1,
                    expert_parallel_size: int = 1, distributed_timeout_s: float = 600.0,
                    fp8_experts: bool | None = None, load_mtp: bool = True):
    """The model for an engine: ``MiMoV2ForCausalLM`` in one process, else a ``MirroredModel``.
    ``fp8_experts``, ``load_mtp``: ``load_model``'s (every rank the same; ``EngineConfig.loads_mtp``)."""
    from llm_core.model.dtype import parse_dtype
    from llm_core.model.loader import load_model

    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    world = max(tensor_parallel_size, expert_parallel_size)
    if world == 1 and torchrun_rank() is None:
        return load_model(model_dir, device=device, dtype=dt, fp8_experts=fp8_experts, load_mtp=load_mtp)
    dev = torch.device(device)
    if dev.type == "cuda" and torchrun_rank() is None and torch.cuda.is_available():
        first = dev.index or 0
        if first + world > torch.cuda.device_count():
            raise ValueError(f"{world} tensor/expert-parallel ranks from {dev} need GPUs {first}..{first + world - 1}; "
                             f"this machine has {torch.cuda.device_count()}")
    spec = LaunchSpec(model_dir=str(model_dir), device=str(dev), dtype=str(dt).removeprefix("torch."),
                      tp_size=tensor_parallel_size, ep_size=expert_parallel_size,
                      init_method="env://" if torchrun_rank() is not None else f"tcp://127.0.0.1:{free_port()}",
                      timeout_s=distributed_timeout_s, fp8_experts=fp8_experts, load_mtp=load_mtp,
                      # CPU ranks compute with theirs; GPU ranks use CPU threads only while loading
                      # (e.g. FP8 dequantisation), so they share the cores instead of each taking all
                      threads=torch.get_num_threads() if dev.type != "cuda" else max(1, torch.get_num_threads() // world))
    rank = torchrun_rank()
    if rank not in (None, 0):
        from llm_core.distributed.worker import worker_main

        worker_main(rank, spec)  # exits the process when rank 0 closes
        sys.exit(0)
    return _start_rank0(spec, load_model, dt)


def _start_rank0(spec: LaunchSpec, load_model, dt):
    from llm_core.distributed.step_mirror import MirroredModel

    group = RankGroup.start(spec)
    try:
        try:
            local = load_model(spec.model_dir, device=group.device, dtype=dt, parallel=group.ctx,
                               fp8_experts=spec.fp8_experts, load_mtp=spec.load_mtp)
        except Exception as exc:
            if not group.processes:
                # torchrun's ranks are not ours to terminate: the handshake tells them to exit
                _tell_failure(group, f"{type(exc).__name__}: {exc}")
            raise
        errors = group.ready(None)
        for rank, error in enumerate(errors):
            if error is not None:
                raise RankFailure(f"tensor/expert-parallel rank {rank} failed to load its shard: {error}")
    except BaseException:
        group.close()  # not serving: terminates the spawned ranks (no StopOp: they are not listening)
        raise
    return MirroredModel(local, group)


def _tell_failure(group: RankGroup, error: str) -> None:
    """Rank 0 failed to load: the other ranks learn it in the ready handshake (bounded: they may
    still be loading) and exit; rank 0's own error is what the caller sees."""
    try:
        group.ready(error, timeout_s=group.spec.timeout_s)
    except Exception:  # noqa: BLE001 -- a rank already gone: nothing to tell it
        pass
