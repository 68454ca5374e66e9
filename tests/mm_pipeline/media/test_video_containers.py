"""VideoContainers: the chunks of one video borrow each other's open containers; the frames are
those of a fresh open per chunk, a failed decode never hands its container on, and close() leaves
nothing open."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tests.support.media_samples import video_bytes

from mm_pipeline.encode.plan import PlannerConfig
from mm_pipeline.media.decode.budget import DecodeBudget, DecodeCancelled, DecodeControl
from mm_pipeline.media.decode.video import decode_range, probe_video
from mm_pipeline.media.decode.video_chunks import VideoContainers, decode_chunk, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind


def _chunks(codec: str) -> tuple[MediaItem, object, tuple[int, ...], list[list[int]]]:
    item = MediaItem(MediaKind.VIDEO, "mp4", video_bytes("mp4", codec, fps=10, n_frames=90, gop=15))
    info = probe_video(item)
    indices = sample_frames(info.total_frames, info.video_fps, VideoSamplingParams(fps=2)).indices
    chunks = plan_chunks(list(range(len(indices) // 2)), indices, info.keyframes, 2, PlannerConfig().groups_per_chunk)
    assert len(chunks) >= 4
    return item, info, indices, chunks


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
@pytest.mark.parametrize("threads", [1, 0])
def test_borrowed_containers_decode_what_fresh_opens_decode(codec: str, threads: int) -> None:
    item, info, indices, chunks = _chunks(codec)
    fresh = [decode_chunk(item, info, indices, c, 2, MediaLimits(), threads=threads) for c in chunks]
    shared = VideoContainers(item)
    # out of order too: a borrowed container stands wherever its last chunk left it
    order = list(range(len(chunks)))[::-1] + list(range(len(chunks)))
    for k in order:
        out = decode_chunk(item, info, indices, chunks[k], 2, MediaLimits(), threads=threads, containers=shared)
        assert torch.equal(out, fresh[k]), k
    assert shared.opened == 1
    # the serial reference (no seek, every frame) from a used container
    targets = sorted(set(indices))
    ref = decode_range(item, info, targets, seek=False, threads=threads)
    assert torch.equal(decode_range(item, info, targets, seek=False, threads=threads, containers=shared), ref)
    shared.close()


def test_concurrent_chunks_open_one_container_each_at_most() -> None:
    item, info, indices, chunks = _chunks("libx264")
    fresh = [decode_chunk(item, info, indices, c, 2, MediaLimits()) for c in chunks]
    shared = VideoContainers(item)
    outs: dict[int, torch.Tensor] = {}
    start = threading.Barrier(2)

    def worker(ks: list[int]) -> None:
        start.wait()
        for k in ks:
            outs[k] = decode_chunk(item, info, indices, chunks[k], 2, MediaLimits(), containers=shared)

    threads = [threading.Thread(target=worker, args=(list(range(w, len(chunks), 2)),)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(torch.equal(outs[k], fresh[k]) for k in range(len(chunks)))
    assert 1 <= shared.opened <= 2
    shared.close()


class _CancelAfter:
    def __init__(self, frames: int) -> None:
        self.left = frames

    def check(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise DecodeCancelled("cancelled")


def test_a_failed_decode_closes_its_container_and_close_leaves_none_open() -> None:
    item, info, indices, chunks = _chunks("libx264")
    shared = VideoContainers(item)
    with shared.lend() as (first, fresh):
        assert fresh
    with pytest.raises(DecodeCancelled):
        decode_chunk(item, info, indices, chunks[1], 2, MediaLimits(), control=_CancelAfter(2), containers=shared)
    with pytest.raises(Exception):  # the failed decode's container was closed, not handed on
        first.streams.video[0]
    assert shared.opened == 1 and not shared._free
    ok = decode_chunk(item, info, indices, chunks[2], 2, MediaLimits(), containers=shared)
    assert shared.opened == 2 and len(shared._free) == 1
    kept = shared._free[0]
    with shared.lend() as (lent, fresh):
        assert lent is kept and not fresh
        shared.close()  # while lent: closed when it comes back
    assert not shared._free
    with pytest.raises(Exception):
        kept.streams.video[0]
    # after close a borrower still gets a working container of its own
    assert torch.equal(decode_chunk(item, info, indices, chunks[2], 2, MediaLimits(), containers=shared), ok)
    assert not shared._free


def test_an_idle_container_holds_its_bytes_in_the_budget_or_is_closed() -> None:
    """Kept idle only while the budget's non-waiting share has room for its decoder's frames; every
    byte is given back when it is borrowed again or closed."""
    item, info, indices, chunks = _chunks("libx264")
    budget = DecodeBudget(1000)  # early share: 500
    roomy = VideoContainers(item, budget, idle_bytes=400)
    decode_chunk(item, info, indices, chunks[0], 2, MediaLimits(), containers=roomy)
    assert budget.early_in_use == budget.in_use == 400 and len(roomy._free) == 1
    with roomy.lend() as (_, fresh):  # borrowed: its bytes go back while a chunk decodes with it
        assert not fresh and budget.early_in_use == 0
    crowded = VideoContainers(item, budget, idle_bytes=200)  # 400 + 200 > the 500 share: not kept
    for c in chunks[:3]:
        decode_chunk(item, info, indices, c, 2, MediaLimits(), containers=crowded)
    assert crowded.opened == 3 and not crowded._free and budget.early_in_use == 400
    roomy.close()
    crowded.close()
    assert budget.in_use == budget.early_in_use == 0
    budget.check_integrity()


def _until(condition, what: str, limit_s: float = 30.0) -> None:
    """Until ``condition()`` holds (a state another thread reaches), failing after ``limit_s``."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.001)


def test_a_waiting_reservation_closes_the_idle_containers_it_needs_the_bytes_of() -> None:
    """The next chunk of a video needs the bytes its idle container holds: that container goes back
    only when a chunk borrows it, and a chunk reserves before it borrows. Before, the reservation
    waited out its deadline (MediaDecodeTimeout here after 5 s, in production the decode deadline)
    beside bytes nobody used; now it has the idle container closed and goes on at once."""
    item, info, indices, chunks = _chunks("libx264")
    budget = DecodeBudget(1000)  # early share: 500
    shared = VideoContainers(item, budget, idle_bytes=400)
    with budget.reserve(300):
        decode_chunk(item, info, indices, chunks[0], 2, MediaLimits(), containers=shared)
    assert budget.in_use == budget.early_in_use == 400 and len(shared._free) == 1
    with budget.reserve(700, DecodeControl(5.0, what="the next chunk")):  # 700 + the idle 400 > 1000
        assert budget.early_in_use == 0 and not shared._free
        decode_chunk(item, info, indices, chunks[1], 2, MediaLimits(), containers=shared)
        assert not shared._free  # no room to keep it idle beside this reservation
    assert shared.opened == 2 and budget.in_use == 0
    shared.close()
    budget.check_integrity()


def test_no_container_is_kept_idle_while_a_reservation_waits() -> None:
    """Room for an idle container's bytes, but a reservation waits for room: the container is
    closed as it comes back rather than kept (it would only be taken back from it at once)."""
    item, info, indices, chunks = _chunks("libx264")
    budget = DecodeBudget(1000)
    shared = VideoContainers(item, budget, idle_bytes=100)
    got: list[int] = []

    def waiter() -> None:
        with budget.reserve(300, DecodeControl(30.0)):
            got.append(budget.in_use)

    with budget.reserve(800):
        thread = threading.Thread(target=waiter)
        thread.start()
        _until(lambda: budget.waiting == 1, "the second reservation waits")
        decode_chunk(item, info, indices, chunks[0], 2, MediaLimits(), containers=shared)  # 800 + 100 fit
        assert not shared._free and budget.early_in_use == 0
    thread.join(30)
    assert got == [300] and budget.waiting == 0
    decode_chunk(item, info, indices, chunks[1], 2, MediaLimits(), containers=shared)  # nobody waits: kept
    assert len(shared._free) == 1 and budget.early_in_use == 100
    shared.close()
    assert budget.in_use == 0
    budget.check_integrity()
