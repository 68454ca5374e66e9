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
        self.queries, self.recorded = 0, False
        _Event.made.append(self)

    def record(self) -> None:
        self.recorded = True

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
    group._closed, group.serving, group.broken, group._device_done = False, True, None, None
    return group


@pytest.fixture
def cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.made.clear()
    yield _Event
    _Event.polls = None


def test_rank0_waits_for_its_stream_after_the_logits(cuda_events):
    """The logits' wait polls the event until the stream passed it; another call's mark is waited
    for before the next message, not at once."""
    group = _group("cuda:0", [_Proc(None)])
    cuda_events.polls = 3
    group.device_done("logits", wait=True)
    assert cuda_events.made[0].recorded and cuda_events.made[0].queries == 5  # 4 polls, then wait()
    group.device_done("forward", wait=False)
    assert cuda_events.made[1].queries == 0 and group._device_done is cuda_events.made[1]
    group.await_device("the last call")
    assert group._device_done is None and group.broken is None


def test_mirrored_calls_wait_for_the_stream_where_it_matters(cuda_events, monkeypatch):
    """A forward's mark is waited for before the next message (a long prefill's chunks must not
    launch on behind a stuck collective), except before the logits: their own wait, right after
    their call, covers the forward too (no bubble between a step's forward and its LM head)."""
    from llm_core.distributed.step_mirror import MirroredModel
    from llm_core.distributed.step_ops import LogitsOp, ReportOp

    group = _group("cuda:0", [_Proc(None)])
    cuda_events.polls = 0
    seen = []
    monkeypatch.setattr(group, "send", lambda op: seen.append((type(op).__name__, [e.queries for e in _Event.made])))
    model = MirroredModel(torch.nn.Linear(1, 1), group)
    model._mirror(ReportOp(), "forward", lambda: None)  # stands for a forward: any call but the logits
    model._mirror(LogitsOp(1), "logits", lambda: None)
    model._mirror(ReportOp(), "forward", lambda: None)
    model._mirror(ReportOp(), "forward", lambda: None)
    assert seen == [("ReportOp", []), ("LogitsOp", [0]), ("ReportOp", [0, 2]), ("ReportOp", [0, 2, 2])]


def test_a_rank_dead_inside_a_collective_fails_the_wait_at_once(cuda_events):
    """A rank that died while rank 0's stream waits in a collective with it: RankFailure naming it
    within the poll interval (the old code blocked in the next GPU read until NCCL's watchdog)."""
    group = _group("cuda:0", [_Proc(-9)])
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid 4242\) exited with code -9 while rank 0 waited for logits"):
        group.device_done("logits", wait=True)
    assert time.monotonic() - start < 1.0
    assert group.broken == "logits failed"


def test_a_stuck_rank_fails_the_wait_after_the_timeout(cuda_events):
    group = _group("cuda:0", [_Proc(None)], timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"did not answer within 0.2 s"):
        group.device_done("logits", wait=True)
    assert 0.2 <= time.monotonic() - start < 2.0


def test_cpu_groups_record_nothing(cuda_events):
    group = _group("cpu", [_Proc(None)])
    group.device_done("logits", wait=True)
    assert cuda_events.made == [] and group._device_done is None


@pytest.mark.parametrize("device,broken,ends", [("cuda:0", "forward failed", "abort"), ("cpu", "forward failed", "destroy"),
                                                 ("cuda:0", None, "destroy")])
def test_close_aborts_a_broken_nccl_group(monkeypatch, device, broken, ends):
    """Out of step on NCCL, rank 0's stream may hold collectives that never finish: close() aborts
    the groups; an orderly group (or gloo) is destroyed as before."""
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    group = _group(device, [])
    group.broken = broken
    monkeypatch.setattr(group, "send", lambda op: calls.append(type(op).__name__))
    group.close()
    assert calls[-1] == ends and (calls == ["StopOp", "destroy"]) == (broken is None)


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
