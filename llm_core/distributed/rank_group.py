"""RankGroup: the processes of one tensor- / expert-parallel engine and the torch.distributed groups
between them.

    mmserve serve / LLM(...)  (rank 0: API, scheduler, sampler, its own shard)
        ├─ spawns ranks 1..W-1 with torch.multiprocessing ("spawn"), or finds them already started
        │  by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment: env:// rendezvous)
        ├─ default group  (NCCL on CUDA, gloo on CPU; timeout distributed_timeout_s): the model's
        │  all-reduces and all-gathers
        └─ control group  (always gloo, on the CPU): one message per model call from rank 0
           (step_ops.py); it waits as long as the server idles, so its timeout is long

A rank that dies is noticed two ways: rank 0 checks its children's exit codes before every message
and while it waits on one, and a collective with a dead peer fails (gloo closes the connection, NCCL
times out); both become :class:`RankFailure` naming the rank.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llm_core.distributed.parallel_context import ParallelContext
from llm_core.distributed.rank_failure import RankFailure

# The control group's timeout: a worker waits on it for the next step while the server is idle.
CONTROL_TIMEOUT = timedelta(days=365)
POLL_S = 0.005


@dataclass(frozen=True)
class LaunchSpec:
    """What every rank needs to join the group and load its shard."""

    model_dir: str
    device: str  # "cpu" or "cuda" (rank r then uses cuda:r, or cuda:$LOCAL_RANK under torchrun)
    dtype: str
    tp_size: int
    ep_size: int
    init_method: str  # tcp://127.0.0.1:PORT, or env:// under torchrun
    timeout_s: float
    threads: int  # torch intra-op threads per rank (CPU)

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def device_of(self, rank: int) -> torch.device:
        if not self.device.startswith("cuda"):
            return torch.device(self.device)
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or any env:// launcher) started a world of several; else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankGroup:
    """This process's membership: its ParallelContext, the control group and (rank 0 only, when it
    spawned them) the other ranks' processes."""

    def __init__(self, spec: LaunchSpec, rank: int, processes: list | None = None) -> None:
        self.spec, self.rank = spec, rank
        self.processes = processes or []  # index k holds rank k + 1
        self.device = spec.device_of(rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        world = spec.world_size
        if torchrun_rank() is not None and int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks; tensor_parallel_size "
                             f"{spec.tp_size} and expert_parallel_size {spec.ep_size} need {world}")
        dist.init_process_group(spec.backend, init_method=spec.init_method, world_size=world, rank=rank,
                                timeout=timedelta(seconds=spec.timeout_s))
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.ctx = ParallelContext(spec.tp_size, spec.ep_size, rank, group=dist.group.WORLD)
        self._closed = False

    # ---- rank 0 ------------------------------------------------------------------------------
    @classmethod
    def start(cls, spec: LaunchSpec) -> "RankGroup":
        """Rank 0: spawn ranks 1..W-1 (unless torchrun started them) and join the group with them."""
        from llm_core.distributed.worker import worker_main

        if torchrun_rank() is not None:
            return cls(spec, torchrun_rank())
        mp = torch.multiprocessing.get_context("spawn")
        procs = [mp.Process(target=worker_main, args=(r, spec), name=f"mmserve-rank{r}", daemon=True)
                 for r in range(1, spec.world_size)]
        for p in procs:
            p.start()
        try:
            group = cls(spec, 0, procs)
        except BaseException:
            _end(procs)
            raise
        atexit.register(group.close)
        return group

    def send(self, op: object) -> None:
        """Rank 0: broadcast one message to every rank (pickled, as broadcast_object_list does, but
        asynchronously so that rank 0 can watch its children while the message goes out)."""
        data = torch.frombuffer(bytearray(pickle.dumps(op)), dtype=torch.uint8)
        self.wait(dist.broadcast(torch.tensor([data.numel()]), src=0, group=self.control, async_op=True),
                  type(op).__name__)
        self.wait(dist.broadcast(data, src=0, group=self.control, async_op=True), type(op).__name__)

    def receive(self) -> object:
        """Ranks > 0: the next message from rank 0 (blocks as long as rank 0 has nothing to say)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return pickle.loads(data.numpy().tobytes())

    def ready(self, what: str) -> None:
        """Barrier after loading (every rank calls it); rank 0 watches the others while it waits."""
        if self.rank == 0:
            self.wait(dist.barrier(group=self.control, async_op=True), what)
        else:
            dist.barrier(group=self.control)

    def gather_reports(self, report: dict) -> list[dict]:
        """Every rank's report, in rank order (all ranks call it)."""
        out: list = [None] * self.spec.world_size
        dist.all_gather_object(out, report, group=self.control)
        return out

    def dead_rank(self) -> str | None:
        """A message naming the first spawned rank that has exited, or None."""
        for r, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def wait(self, work, what: str) -> None:
        """Wait for an async collective of rank 0 while watching the other ranks' processes."""
        try:
            delay = 0.0  # a step's messages complete in microseconds: back off from a spin, not a 5 ms nap
            while not work.is_completed():
                dead = self.dead_rank()
                if dead is not None:
                    raise RankFailure(f"tensor/expert-parallel {dead} while rank 0 waited for {what}")
                time.sleep(delay)
                delay = min(POLL_S, 2 * delay + 5e-5)
            work.wait()
        except RankFailure:
            raise
        except Exception as exc:  # a collective with a dead or stuck peer
            raise self.failure(what, exc) from exc

    def failure(self, what: str, exc: BaseException) -> RankFailure:
        """The RankFailure for a failed collective, naming a dead rank when there is one."""
        deadline = time.monotonic() + 2.0  # the peer's exit may trail its closed socket a little
        while (dead := self.dead_rank()) is None and self.processes and time.monotonic() < deadline:
            time.sleep(0.05)
        who = dead or "a rank stopped answering"
        return RankFailure(f"tensor/expert-parallel {who} during {what}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Tell the other ranks to stop (rank 0), wait for them briefly, leave the process group."""
        if self._closed:
            return
        self._closed = True
        if self.rank == 0 and self.dead_rank() is None:
            from llm_core.distributed.step_ops import StopOp

            try:
                self.send(StopOp())
            except Exception:  # noqa: BLE001 -- a rank is gone already: nothing to tell it
                pass
        _end(self.processes)
        if dist.is_initialized():
            dist.destroy_process_group()


def _end(procs: list, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
