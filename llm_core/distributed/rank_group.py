"""RankGroup: the processes of one tensor- / expert-parallel engine and the torch.distributed groups
between them.

    mmserve serve / LLM(...)  (rank 0: API, scheduler, sampler, its own shard)
        ├─ spawns ranks 1..W-1 with torch.multiprocessing ("spawn"), or finds them already started
        │  by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment: env:// rendezvous)
        ├─ default group  (NCCL on CUDA, gloo on CPU; timeout distributed_timeout_s): the model's
        │  all-reduces and the logits' gather
        └─ control group  (always gloo, on the CPU): one message per model call from rank 0
           (step_ops.py); it waits as long as the server idles, so its timeout is long

A rank that dies is noticed two ways: rank 0 checks its children's exit codes while they join,
before every message and while it waits on one, and a collective with a dead peer fails (gloo
closes the connection, NCCL times out); both become :class:`RankFailure` naming the rank.

Rank 0 marks the group ``broken`` from each message until its own half of that call has returned
(``settle``): when the call raises instead, the other ranks may sit in a collective rank 0 will never
make, so the group is not used again and ``close`` terminates the children instead of telling them.
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
from llm_core.distributed.step_ops import StopOp

# The control group's timeout: a worker waits on it for the next step while the server is idle.
CONTROL_TIMEOUT = timedelta(days=365)
POLL_S = 0.005
SPIN_S = 5e-5  # the nap between polls of rank 0's stream (a step's GPU work ends in milliseconds)
# Each rank's load outcome in the ready handshake: a flag byte, then the error text (truncated)
READY_BYTES = 4096


@dataclass(frozen=True)
class LaunchSpec:
    """What every rank needs to join the group and load its shard."""

    model_dir: str
    device: str  # "cpu", or "cuda[:N]" (rank r then uses cuda:N+r, or cuda:N+$LOCAL_RANK under torchrun)
    dtype: str
    tp_size: int
    ep_size: int
    init_method: str  # tcp://127.0.0.1:PORT, or env:// under torchrun
    timeout_s: float
    threads: int  # torch intra-op threads per rank (CPU)
    fp8_experts: bool | None = None  # load_model's: the routed experts kept in block-FP8
    load_mtp: bool = True  # load_model's: the MTP layers (not when speculative decoding is off)

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def device_of(self, rank: int) -> torch.device:
        """Rank ``rank``'s device: on CUDA the ``rank``-th GPU from the given one (``cuda:4`` puts a
        world of 2 on GPUs 4 and 5), or under torchrun the ``LOCAL_RANK``-th -- only there: a
        ``LOCAL_RANK`` some other launcher left in the environment would put every rank this
        process spawns on one GPU."""
        if not self.device.startswith("cuda"):
            return torch.device(self.device)
        base = torch.device(self.device).index or 0
        local = int(os.environ.get("LOCAL_RANK", rank)) if torchrun_rank() is not None else rank
        return torch.device("cuda", base + local)


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
        self._closed = False
        self.serving = False  # every rank loaded its shard (ready): only then may close() send StopOp
        self.broken: str | None = None  # rank 0: why the ranks may be out of step (see the module doc)
        self.stopped = False  # ranks > 0: rank 0's StopOp arrived (a clean exit: close() destroys the groups)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        world = spec.world_size
        if torchrun_rank() is not None and int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks; tensor_parallel_size "
                             f"{spec.tp_size} and expert_parallel_size {spec.ep_size} need {world}")
        self._rendezvous()
        self.ctx = ParallelContext(spec.tp_size, spec.ep_size, rank, group=dist.group.WORLD)

    def _rendezvous(self) -> None:
        """Join the default and control groups. Spawned ranks meet on rank 0's TCP store and each
        checks in there first, so that rank 0 can wait for them while it watches their processes: a
        child that dies before joining (no such device, an import error, killed for memory) would
        otherwise leave rank 0 in init_process_group for the whole timeout, with an error naming no
        rank. Under torchrun (env://) its agent watches the processes."""
        spec = self.spec
        timeout = timedelta(seconds=spec.timeout_s)
        # NCCL bound to this rank's GPU: its communicator forms here, at start-up, not inside the
        # first request's first collective (beside that request's kernel compiles, under its timeout)
        bound = {"device_id": self.device} if spec.backend == "nccl" else {}
        if spec.init_method.startswith("tcp://"):
            host, port = spec.init_method.removeprefix("tcp://").rsplit(":", 1)
            store = dist.TCPStore(host, int(port), spec.world_size, is_master=self.rank == 0, timeout=timeout,
                                  wait_for_workers=False)
            if self.rank == 0:
                self._await_ranks(store)
            else:
                store.set(f"mmserve/joined/{self.rank}", "1")
            dist.init_process_group(spec.backend, store=store, world_size=spec.world_size, rank=self.rank,
                                    timeout=timeout, **bound)
        else:
            dist.init_process_group(spec.backend, init_method=spec.init_method, world_size=spec.world_size,
                                    rank=self.rank, timeout=timeout, **bound)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def _await_ranks(self, store) -> None:
        """Rank 0: wait until every other rank has checked in at the store (at most the timeout)."""
        keys = [f"mmserve/joined/{r}" for r in range(1, self.spec.world_size)]
        deadline = time.monotonic() + self.spec.timeout_s
        while not store.check(keys):
            dead = self.dead_rank()
            if dead is not None:
                raise RankFailure(f"tensor/expert-parallel {dead} before joining the group")
            if time.monotonic() > deadline:
                missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
                raise RankFailure(f"tensor/expert-parallel rank(s) {', '.join(missing)} did not join the group "
                                  f"within {self.spec.timeout_s:g} s (distributed_timeout_s)")
            time.sleep(0.05)

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
            _end(procs, 0.0)
            raise
        atexit.register(group.close)
        return group

    def send(self, op: object) -> None:
        """Rank 0: broadcast one message to every rank (pickled, as broadcast_object_list does, but
        asynchronously so that rank 0 can watch its children while the message goes out). Each wait
        is bounded by distributed_timeout_s: a rank that stopped receiving must not hang rank 0."""
        name = type(op).__name__
        if self.broken is not None:
            raise RankFailure(f"tensor/expert-parallel ranks out of step since {self.broken}; the engine "
                              f"must be closed")
        self.broken = f"{name} was cut short"  # cleared by settle() once rank 0's half returned
        data = torch.frombuffer(bytearray(pickle.dumps(op)), dtype=torch.uint8)
        for tensor in (torch.tensor([data.numel()]), data):
            self.wait(dist.broadcast(tensor, src=0, group=self.control, async_op=True), name, self.spec.timeout_s)

    def device_done(self, what: str) -> None:
        """Rank 0 on CUDA, after its half of a call that launched collectives: wait until its stream
        has run them, watching the other ranks. A collective on NCCL returns to the host before the
        other ranks arrive, so after a rank died mid-step rank 0 would block in its next read of GPU
        data -- the sampler's, or the input copies of a long prompt's next chunk -- a wait that
        watches nothing, until NCCL's watchdog tears the process down after distributed_timeout_s.
        This wait names the dead rank (RankFailure) within a poll and is bounded by that timeout.
        It costs a step the launch of its next call after the GPU drained (the LM head after the
        forward), ~0.1 ms, against a hang."""
        if self.device.type != "cuda":
            return  # gloo's collectives are synchronous: a dead peer fails them at once
        done = torch.cuda.Event()
        # this device's stream in this thread: the engine thread's current device may be another
        done.record(torch.cuda.current_stream(self.device))
        try:
            self.wait(_EventWork(done), what, self.spec.timeout_s, spin=True)
        except RankFailure:
            self.broken = f"{what} failed"
            raise

    def settle(self) -> None:
        """Rank 0: the call of the last message returned on rank 0, so every rank met its collectives."""
        self.broken = None

    def receive(self) -> object:
        """Ranks > 0: the next message from rank 0 (blocks as long as rank 0 has nothing to say)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        op = pickle.loads(data.numpy().tobytes())
        self.stopped = isinstance(op, StopOp)
        return op

    def ready(self, error: str | None, timeout_s: float | None = None) -> list[str | None]:
        """The load handshake: every rank calls it once after loading, with None or its error text,
        and gets every rank's, in rank order -- so rank 0 can name a worker's load error and a worker
        knows to exit when another rank failed. Rank 0 watches the others while it waits (at most
        ``timeout_s``). With every rank loaded the group is serving."""
        mine = torch.zeros(READY_BYTES, dtype=torch.uint8)
        if error is not None:
            mine[0] = 1
            text = error.encode()[:READY_BYTES - 1]
            if text:
                mine[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.spec.world_size)]
        work = dist.all_gather(parts, mine, group=self.control, async_op=True)
        if self.rank == 0:
            self.wait(work, "the other ranks to load their shards", timeout_s)
        else:
            work.wait()
        out = [None if int(p[0]) == 0 else bytes(p[1:].numpy()).rstrip(b"\0").decode(errors="replace") or "?"
               for p in parts]
        self.serving = all(e is None for e in out)
        return out

    def all_agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (all ranks call it; a gather on the control group)."""
        return all(self.gather_objects(ok))

    def gather_objects(self, mine: object) -> list:
        """Every rank's ``mine`` (a report, a memory budget), in rank order (all ranks call it)."""
        out: list = [None] * self.spec.world_size
        dist.all_gather_object(out, mine, group=self.control)
        return out

    def dead_rank(self) -> str | None:
        """A message naming the first spawned rank that has exited, or None."""
        for r, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def wait(self, work, what: str, timeout_s: float | None = None, spin: bool = False) -> None:
        """Wait for an async collective of rank 0 (or, ``spin``, for its GPU stream: ``SPIN_S`` naps,
        since a nap past the end of a step's GPU work adds to every step) while watching the other
        ranks' processes (at most every ``POLL_S`` when spinning). Under torchrun there are none to
        watch: its agent ends every rank when one dies."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            delay = 0.0  # a step's messages complete in microseconds: back off from a spin, not a 5 ms nap
            checked = float("-inf")
            while not work.is_completed():
                now = time.monotonic()
                if not spin or now - checked >= POLL_S:
                    checked = now
                    dead = self.dead_rank()
                    if dead is not None:
                        raise RankFailure(f"tensor/expert-parallel {dead} while rank 0 waited for {what}")
                    if deadline is not None and now > deadline:
                        raise RankFailure(f"tensor/expert-parallel ranks did not answer within {timeout_s:g} s "
                                          f"(distributed_timeout_s) while rank 0 waited for {what}")
                # spinning: short real naps (the GIL free for the server's threads), never a long one
                time.sleep(SPIN_S if spin else delay)
                delay = min(POLL_S, 2 * delay + 5e-5)
            work.wait()
        except RankFailure:
            raise
        except Exception as exc:  # a collective with a dead or stuck peer
            raise self.failure(what, exc) from exc

    def failure(self, what: str, exc: BaseException) -> RankFailure:
        """The RankFailure for a failed call, naming a dead rank when there is one; marks the group
        broken (rank 0 no longer knows which collective each rank is in)."""
        self.broken = f"{what} failed ({type(exc).__name__})"
        dead = self.dead_rank()
        if dead is None and not _is_collective_error(exc):  # rank 0's own error, e.g. out of memory
            return RankFailure(f"tensor/expert-parallel rank 0 failed during {what} (the other ranks are "
                               f"left inside that call): {type(exc).__name__}: {exc}")
        deadline = time.monotonic() + 2.0  # the peer's exit may trail its closed socket a little
        while dead is None and self.processes and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead_rank()
        who = dead or "a rank stopped answering"
        return RankFailure(f"tensor/expert-parallel {who} during {what}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Leave the group. Rank 0 of a serving, in-step group tells the others to stop and waits for
        them briefly; one that never reached serving, or whose ranks may be out of step (broken),
        terminates its children instead: a StopOp would meet them inside another collective and wait
        there until the control group's timeout."""
        if self._closed:
            return
        self._closed = True
        orderly = self.rank == 0 and self.serving and self.broken is None and self.dead_rank() is None
        if orderly:
            try:
                self.send(StopOp())
            except Exception:  # noqa: BLE001 -- a rank is gone or stuck: terminated below
                orderly = False
        _end(self.processes, 10.0 if orderly else 0.0)
        if dist.is_initialized():
            if self.spec.backend == "nccl" and not (orderly or self.stopped):
                _abort_groups()
            else:
                if self.device.type == "cuda":  # this rank's own collectives done before NCCL's teardown
                    torch.cuda.synchronize(self.device)
                dist.destroy_process_group()


class _EventWork:
    """A CUDA event seen as the work handle ``RankGroup.wait`` polls."""

    def __init__(self, event) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


def _abort_groups() -> None:
    """Tear the NCCL groups down without waiting: rank 0's stream may hold collectives a gone rank
    will never join, which ``destroy_process_group`` would wait on (NCCL's abort ends them)."""
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 -- the process is ending on a failure: destroy is what is left
        dist.destroy_process_group()


def _is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective (a peer gone or stuck) rather than rank 0's own code."""
    dist_error = getattr(dist, "DistError", ())
    text = str(exc).lower()
    return isinstance(exc, (RankFailure, dist_error)) or "gloo" in text or "nccl" in text


def _end(procs: list, timeout_s: float = 10.0) -> None:
    """Join the processes for up to ``timeout_s``, then terminate (and at last kill) the rest."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
