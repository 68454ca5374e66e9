"""The KV tiers' CUDA paths with torch.cuda stood in (no GPU here; the copies run on the CPU pool):
the host pool page-locked at its exact size on the pool's GPU, and the loader's copy stream ordered
by events against the engine's stream."""

from __future__ import annotations

import contextlib

import pytest
import torch

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.kvcache.tiers.host_kv_pool import HostKVPool, row_elements
from llm_core.kvcache.tiers.page_format import layer_columns
from llm_core.kvcache.tiers.tier_threads import KVTierThreads, add_layer_copies
from tests.llm_core.kvcache.tiers.test_kv_tiers import LAYOUT


@contextlib.contextmanager
def _current(stack: list, device):
    """A stand-in for ``torch.cuda.device(device)``: ``device`` current (on ``stack``) in the body."""
    stack.append(str(device))
    try:
        yield
    finally:
        stack.pop()


def test_host_pool_page_locks_its_rows_at_their_exact_size(monkeypatch):
    """On CUDA the host rows are page-locked at exactly their bytes (torch's pin_memory would lock
    the next power of two: 40 GB -> 64 GB), with the pool's device current (not GPU 0), unlocked
    when the pool goes (before the memory is freed); a refused registration is an error naming
    what to lower. The CUDA runtime is stood in for (no GPU here): it records what it is asked."""
    import gc

    calls: list[tuple] = []
    current = ["cuda:0"]

    class Runtime:
        refuse = False

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags, current[-1]))
            return 2 if self.refuse else 0  # cudaErrorMemoryAllocation / cudaSuccess

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    runtime = Runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "device", lambda device: _current(current, device))
    full_row = row_elements(LAYOUT, "full", 2) * 4
    gpu1 = torch.device("cuda:1")
    host = HostKVPool(LAYOUT, 2, torch.float32, 5 * full_row * 2, swa_fraction=0.5, pin_for=gpu1)
    sizes = {c[1]: c[2] for c in calls if c[0] == "register"}
    assert sizes == {host.full_data.data_ptr(): host.full_data.numel() * 4,
                     host.swa_data.data_ptr(): host.swa_data.numel() * 4}
    assert host.num_full_rows == 5 and all(b.pinned for b in host._buffers)  # 5 rows: not a power of two
    assert all(c[3] == 1 and c[4] == "cuda:1" for c in calls)  # portable, registered on the pool's GPU
    host.put(b"k", torch.ones(host.full_elems), torch.ones(host.swa_elems))
    assert torch.equal(host.full_data[host.get(b"k").full_row], torch.ones(host.full_elems))
    del host
    gc.collect()
    assert sorted(c[1] for c in calls if c[0] == "unregister") == sorted(sizes)
    runtime.refuse = True
    with pytest.raises(RuntimeError, match="could not page-lock .* lower kv_host_bytes"):
        HostKVPool(LAYOUT, 2, torch.float32, 5 * full_row * 2, pin_for=gpu1)
    assert not HostKVPool(LAYOUT, 2, torch.float32, 5 * full_row * 2)._buffers[0].pinned  # no device: pageable


def test_cuda_loads_copy_on_their_own_stream_ordered_by_events(monkeypatch):
    """The loader's CUDA protocol, with torch.cuda stood in (no GPU here; the copies themselves run
    on the CPU pool): the copy stream waits for the engine's work queued at submit before copying;
    each layer's copies end in an event recorded on the copy stream; a step reading layer i makes
    its own stream wait for that layer's event (never a host sync); a finished job is settled on the
    reading stream before it is forgotten. The copies run with the pool's GPU current (cuda:1 here).
    A job that fails part-way is settled too (its queued copies land in pages L1 may reuse) and
    its error reaches the step. The rows land."""
    log: list[tuple] = []

    class Event:
        def __init__(self):
            self.name = f"e{sum(1 for x in log if x[0] == 'record')}"

        def record(self, stream):
            log.append(("record", self.name, stream.name))

    class Stream:
        def __init__(self, name="copy"):
            self.name = name

        def wait_event(self, event):
            log.append(("wait", self.name, event.name))

        def synchronize(self):
            log.append(("sync", self.name))

    engine_stream = Stream("engine")
    current = [engine_stream]

    class UseStream:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    devices = ["cuda:0"]  # the loader thread's current device
    monkeypatch.setattr(torch.cuda, "device", lambda device: _current(devices, device))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", UseStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    from llm_core.kvcache.tiers import tier_threads

    copied_on: list[str] = []
    real_scatter = tier_threads.scatter_layer

    def scatter(pool, layer, pages, part):
        copied_on.append((current[-1].name, devices[-1]))
        log.append(("copy", layer))
        real_scatter(pool, layer, pages, part)

    monkeypatch.setattr(tier_threads, "scatter_layer", scatter)
    pool = DualKVPool(LAYOUT, num_full_tokens=16, num_swa_tokens=16, page_size=2)
    threads = KVTierThreads(pool, None)
    threads.order = tier_threads.CopyOrder(torch.device("cuda:1"))  # as a pool on the second GPU's would be
    rows = [torch.randn(row_elements(LAYOUT, "full", 2))]
    copies: dict = {}
    add_layer_copies(copies, pool, "full", [3], rows)
    job = threads.submit(copies)
    assert log[0] == ("record", "e0", "engine")  # the engine's work so far
    view = threads.kv_buffers(pool)
    for i in range(3):
        k, _ = view.layer(i)
    job.events[-1].wait()
    assert log[1] == ("wait", "copy", "e0")  # copies only after the engine's queued work
    assert copied_on == [("copy", "cuda:1")] and not any(x[0] == "sync" for x in log)  # the pool's GPU current
    landed = [x for x in log if x[0] == "record" and x[2] == "copy"]
    assert len(landed) == 3 and log.index(("copy", 0)) < log.index(landed[0])
    for i in range(3):
        assert ("wait", "engine", landed[i][1]) in log  # each layer read after its own event
    full_layer = LAYOUT.layer_kinds.index("full")
    cols = layer_columns(LAYOUT, 2, full_layer)
    assert torch.equal(pool.layer(full_layer)[0][6:8].reshape(-1), rows[0][cols][: 2 * 2 * 3])
    log.clear()
    assert threads.kv_buffers(pool) is pool and log == [("wait", "engine", landed[-1][1])]  # settled, then forgotten

    def fail_second(pool, layer, pages, part):
        if layer > 0:  # layer 0 (no rows in this job) is done, the first sliding layer fails
            raise RuntimeError("disk gone")
        scatter(pool, layer, pages, part)

    monkeypatch.setattr(tier_threads, "scatter_layer", fail_second)
    copies2: dict = {}
    add_layer_copies(copies2, pool, "sliding", [1], [torch.randn(row_elements(LAYOUT, "sliding", 2))])
    job = threads.submit(copies2)
    job.events[-1].wait()
    log.clear()
    with pytest.raises(RuntimeError, match="disk gone"):
        threads.kv_buffers(pool)
    assert log == [("wait", "engine", job.landed[-1].name)] and job.landed[-1] is not None  # its copies ordered
    assert threads.kv_buffers(pool) is pool  # reported once, forgotten
    threads.stop()
