"""Per-thread intra-op counts (runtime/cpu_threads/intra_op.py): a thread's own count moves no other thread's."""

from __future__ import annotations

import threading

import pytest
import torch

from mm_pipeline.runtime.cpu_threads.intra_op import _libraries, set_local_threads, set_process_default


@pytest.fixture
def default_one():
    before = torch.get_num_threads()
    set_process_default(1)
    yield
    set_process_default(before)


def test_a_local_count_stays_on_its_thread(default_one):
    seen: dict[str, int] = {}
    wide_set, done = threading.Event(), threading.Event()

    def wide() -> None:
        set_local_threads(2)
        seen["wide"] = torch.get_num_threads()
        wide_set.set()
        done.wait(10)

    def other() -> None:  # never sets a count: starts at the process default
        seen["other"] = torch.get_num_threads()

    a = threading.Thread(target=wide)
    a.start()
    assert wide_set.wait(10)
    b = threading.Thread(target=other)
    b.start()
    b.join()
    done.set()
    a.join()
    assert seen == {"wide": 2, "other": 1}
    with pytest.raises(ValueError, match=">= 1"):
        set_local_threads(0)


@pytest.mark.parametrize("widen", ["local", "torch"])
def test_a_thread_that_never_set_a_count_runs_at_the_default_while_another_is_wide(default_one, widen):
    """The failure this module prevents ("torch"): torch.set_num_threads(2) on the wide thread also
    moves the process-wide value and MKL's global count, so a thread starting meanwhile (an encoder
    lane, a KV tier writer) runs its ops on a team of its own. With set_local_threads it stays at 1."""
    _, mkl = _libraries()
    x = torch.randn(256, 256)
    ready, done = threading.Event(), threading.Event()

    def wide() -> None:
        (set_local_threads if widen == "local" else torch.set_num_threads)(2)
        x @ x
        ready.set()
        done.wait(10)

    a = threading.Thread(target=wide)
    a.start()
    assert ready.wait(10)
    seen: list[tuple[int, int | None]] = []

    def other() -> None:
        x @ x  # its first op: torch's per-thread init reads the process-wide value
        seen.append((torch.get_num_threads(), mkl.MKL_Get_Max_Threads() if mkl is not None else None))

    b = threading.Thread(target=other)
    b.start()
    b.join()
    done.set()
    a.join()
    expect = 1 if widen == "local" else 2
    assert seen[0][0] == expect and seen[0][1] in (expect, None)
