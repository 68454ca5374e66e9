"""Data parallelism for demo training across CPU processes (gloo on the loopback device).

Why: the demo model's matmuls are small, so a second *thread* buys nothing (measured 0.6 s/step
with 1 or 2 threads), but a second *process* on the second core runs a second batch at full
speed. Every rank holds the same model (same seed, same init), runs its own batch, and the
gradients are averaged before the optimizer step, so the replicas never drift apart:

    rank 0: batch 2k   ─► backward ─┐
                                    ├─ all_reduce(sum) / world ─► clip ─► AdamW (identical on both)
    rank 1: batch 2k+1 ─► backward ─┘

A time-budgeted schedule reads the wall clock; each rank's clock differs slightly, so rank 0's
elapsed time is broadcast every step (:meth:`agree`) and every rank takes the same learning rate
and the same stop decision -- without it one rank could run one step more and hang the other in
its all_reduce.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterable, Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def rendezvous_file() -> Iterator[str]:
    """A fresh path for the ranks' rendezvous (a gloo FileStore: no TCP store server thread, whose
    teardown at exit aborted rank 0 now and then); its directory is removed when the group is done."""
    with tempfile.TemporaryDirectory(prefix="mmserve-dp-") as d:
        yield os.path.join(d, "rendezvous")


class DataParallel:
    """One rank of a ``world``-process group; with ``world == 1`` every method is a no-op."""

    def __init__(self, rank: int = 0, world: int = 1, rendezvous: str | None = None) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank {rank} of {world}")
        self.rank, self.world = rank, world
        if world > 1:
            if rendezvous is None:
                raise ValueError("a multi-process group needs a rendezvous file path (see rendezvous_file())")
            # Gloo otherwise picks the interface its hostname resolves to: keep rendezvous *and*
            # the ranks' all_reduce traffic on the loopback device.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace every gradient with its mean over the ranks, in one flat all_reduce. A parameter
        this rank did not reach (an aux head with no target in its batch) counts as zero and gets a
        gradient, so every rank reduces the same buffer layout."""
        if self.world == 1:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def agree(self, value: float) -> float:
        """Rank 0's ``value`` on every rank (elapsed time, stop flags)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(t, src=0)
        return float(t.item())

    def close(self) -> None:
        """Tear the group down together, so no rank destroys the group while the other's gloo
        threads still talk to it (with a TCP rendezvous and no barrier, rank 0 aborted at exit with
        "terminate called without an active exception" in ~1 of 10 test runs; 0 of 45 since)."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def exit_worker(self) -> None:
        """End a spawned rank: tear the group down, flush, and leave with ``os._exit(0)``.

        Even after ``destroy_process_group`` a gloo worker thread can still be joinable when the
        interpreter runs C++ static destructors at a normal exit, and then the process aborts with
        "terminate called without an active exception" (seen in ~1 of 10 two-rank runs, on either
        rank). Everything a rank produces is written before this call, so skipping the
        interpreter's teardown loses nothing. A single process (world 1) returns normally.
        """
        self.close()
        if self.world > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
