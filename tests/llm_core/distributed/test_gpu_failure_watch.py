"""What keeps a failed rank from hanging a GPU group (docs/parallelism.md §5), with torch.cuda's event
stood in on this CPU machine: rank 0 waits for its stream after a call's NCCL collectives while it
watches the other ranks, a broken NCCL group is aborted rather than destroyed, and a spawned rank
exits when the process that spawned it is gone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from llm_core.distributed import rank_group
from llm_core.distributed.rank_failure import RankFailure
from llm_core.distributed.rank_group import LaunchSpec, RankGroup


class _Event:
    """torch.cuda.Event stood in: done after ``polls`` queries (never with None)."""

    polls: int | None = None
    made: list["_Event"] = []

    def __init__(self) -> None:
        self.queries, self.stream = 0, None
        _Event.made.append(self)

    def record(self, stream=None) -> None:
        self.stream = stream

    def query(self) -> bool:
        self.queries += 1
        return _Event.polls is not None and self.queries > _Event.polls

    def synchronize(self) -> None:
        assert self.query(), "synchronize() on an unfinished event: the wait would block"


class _Proc:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode, self.pid = exitcode, 4242

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.exitcode = -15


def _group(device: str, processes: list, timeout_s: float = 30.0) -> RankGroup:
    """A rank-0 group as RankGroup.start leaves it, without the processes and process groups."""
    group = object.__new__(RankGroup)
    group.spec = LaunchSpec(model_dir="m", device=device, dtype="bfloat16", tp_size=2, ep_size=1,
                            init_method="tcp://127.0.0.1:1", timeout_s=timeout_s, threads=1)
    group.rank, group.processes, group.device = 0, processes, torch.device(device)
    group._closed, group.serving, group.broken, group.stopped = False, True, None, False
    return group


@pytest.fixture
def cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    _Event.made.clear()
    yield _Event
    _Event.polls = None


def test_rank0_waits_for_its_stream_on_its_own_device(cuda_events):
    """The wait polls an event recorded on the group's GPU's stream -- not the calling thread's
    current device's (the server's engine thread has cuda:0 current; rank 0 may be on cuda:4) --
    until the stream passed it."""
    group = _group("cuda:4", [_Proc(None)])
    cuda_events.polls = 3
    group.device_done("logits")
    (event,) = cuda_events.made
    assert event.stream == ("stream of", torch.device("cuda:4"))
    assert event.queries == 5 and group.broken is None  # 4 polls, then wait()


def test_every_call_with_collectives_waits_for_the_stream(cuda_events, monkeypatch):
    """Embedding, forward and logits calls launch NCCL collectives: each is waited for before the
    call returns (a long prompt's chunks have no logits, and the next chunk's input copies would
    block, unwatched, behind a collective a dead rank never joins). Control-only calls do not."""
    from llm_core.distributed.step_mirror import MirroredModel
    from llm_core.distributed.step_ops import EmbedOp, ForwardOp, LogitsOp, ReportOp

    group = _group("cuda:0", [_Proc(None)])
    cuda_events.polls = 0
    seen = []
    monkeypatch.setattr(group, "send", lambda op: seen.append(type(op).__name__))
    model = MirroredModel(torch.nn.Linear(1, 1), group)
    calls = [EmbedOp(torch.zeros(1)), ForwardOp({}, None, None, (0, 0)), LogitsOp(1), ReportOp()]
    waited = []
    for op in calls:
        model._mirror(op, type(op).__name__, lambda: None)
        waited.append(len(cuda_events.made))
    assert seen == ["EmbedOp", "ForwardOp", "LogitsOp", "ReportOp"] and waited == [1, 2, 3, 3]
    assert all(e.queries == 2 for e in cuda_events.made)  # each polled until done before the call returned


def test_a_rank_dead_inside_a_collective_fails_the_wait_at_once(cuda_events):
    """A rank that died while rank 0's stream waits in a collective with it: RankFailure naming it
    within the poll interval (the old code blocked in the next GPU read until NCCL's watchdog)."""
    group = _group("cuda:0", [_Proc(-9)])
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid 4242\) exited with code -9 while rank 0 waited for logits"):
        group.device_done("logits")
    assert time.monotonic() - start < 1.0
    assert group.broken == "logits failed"


def test_a_stuck_rank_fails_the_wait_after_the_timeout(cuda_events):
    group = _group("cuda:0", [_Proc(None)], timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"did not answer within 0.2 s"):
        group.device_done("logits")
    assert 0.2 <= time.monotonic() - start < 2.0


def test_cpu_groups_record_nothing(cuda_events):
    group = _group("cpu", [_Proc(None)])
    group.device_done("logits")
    assert cuda_events.made == []


@pytest.mark.parametrize("device,rank,broken,stopped,want", [
    ("cuda:0", 0, "forward failed", False, ["abort"]),  # rank 0, out of step
    ("cpu", 0, "forward failed", False, ["destroy"]),  # gloo: destroy as before
    ("cuda:0", 0, None, False, ["StopOp", "sync", "destroy"]),  # rank 0, orderly
    ("cuda:1", 1, None, True, ["sync", "destroy"]),  # a worker told to stop: its collectives done first
    ("cuda:1", 1, None, False, ["abort"]),  # a worker that lost rank 0
])
def test_close_aborts_nccl_groups_only_on_failure(monkeypatch, device, rank, broken, stopped, want):
    """Out of step on NCCL, a rank's stream may hold collectives that never finish: close() aborts
    the groups. A clean stop (rank 0 orderly, a worker after StopOp) lets its own collectives finish
    and destroys them; gloo always destroys."""
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    group = _group(device, [])
    group.rank, group.broken, group.stopped = rank, broken, stopped
    monkeypatch.setattr(group, "send", lambda op: calls.append(type(op).__name__))
    group.close()
    assert calls == want


ORPHAN = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", '''
    import time
    from llm_core.distributed.worker import exit_with_parent
    exit_with_parent(poll_s=0.05)
    print("watching", flush=True)
    time.sleep(60)
    '''], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "watching"
    print(child.pid, flush=True)
    # this process (rank 0) ends here without stopping its child
""")


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" in status.read_text()  # exited, not yet reaped by its new parent
    except OSError:
        return True


def test_a_spawned_rank_exits_when_rank0_is_gone():
    """Rank 0 killed (here: it just ends) leaves its spawned ranks orphaned: they notice the new
    parent and exit within the poll interval instead of waiting in a collective for the watchdog."""
    run = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, run.stderr[-2000:]
    pid = int(run.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), f"the orphaned rank {pid} is still running"
