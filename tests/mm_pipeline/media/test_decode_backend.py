"""The process decode backend: the same frames bit for bit as the thread backend, limits checked in
the worker before it allocates, and no shared-memory block left behind after a result, an error, a
cancellation, a worker crash or a shutdown; a crash fails only the job that causes it."""

from __future__ import annotations

import dataclasses
import glob
import os
import signal
import threading
import time
from multiprocessing import shared_memory

import pytest
import torch
from tests.support.media_samples import animated_bytes, image_bytes, video_bytes

from mm_pipeline.errors import MediaTooLarge, UndecodableMediaError
from mm_pipeline.media.decode import input_blocks
from mm_pipeline.media.decode import worker_jobs
from mm_pipeline.media.decode.backend import DecodeWorkerDied, ProcessDecodeBackend, ThreadDecodeBackend
from mm_pipeline.media.decode.budget import DecodeCancelled, DecodeControl
from mm_pipeline.media.decode.image import probe_animation
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import DeferredMediaItem, MediaItem, MediaKind
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames

LIMITS = MediaLimits()
VIDEO = MediaItem(MediaKind.VIDEO, "mp4", video_bytes(n_frames=40, size=(96, 64), gop=5), "test")
LONG = MediaItem(MediaKind.VIDEO, "mp4", video_bytes(n_frames=600, size=(320, 240), gop=600), "test")


@pytest.fixture(scope="module")
def backend():
    b = ProcessDecodeBackend(2)
    b.warm()
    yield b
    b.shutdown()
    assert_no_blocks(b)


def assert_no_blocks(b: ProcessDecodeBackend) -> None:
    assert glob.glob(f"/dev/shm/{b.prefix}*") == []


def chunk_args(item: MediaItem, size=(32, 48)):
    info = probe_video(item, LIMITS)
    sampling = sample_frames(info.total_frames, info.video_fps, VideoSamplingParams(fps=5.0, max_frames=64))
    return info, sampling.indices


def test_same_frames_as_the_thread_backend(backend):
    info, indices = chunk_args(VIDEO)
    for groups in ([0], [1, 2], [len(indices) // 2 - 1]):
        for size in ((32, 48), (64, 96)):
            got = backend.decode_chunk(VIDEO, info, indices, groups, 2, LIMITS, size)
            want = ThreadDecodeBackend().decode_chunk(VIDEO, info, indices, groups, 2, LIMITS, size)
            assert got.dtype == torch.uint8 and got.shape == want.shape and torch.equal(got, want)
    gif = MediaItem(MediaKind.VIDEO, "gif", animated_bytes(n_frames=6), "test")
    anim = probe_animation(gif, LIMITS)
    idx = list(range(anim.num_frames))
    assert torch.equal(backend.decode_chunk(gif, None, idx, [0, 1], 2, LIMITS, (24, 32)),
                       ThreadDecodeBackend().decode_chunk(gif, None, idx, [0, 1], 2, LIMITS, (24, 32)))
    for fmt, target in (("PNG", None), ("JPEG", (40, 60)), ("PNG", (20, 30))):
        img = MediaItem(MediaKind.IMAGE, fmt.lower(), image_bytes(fmt, size=(160, 120)), "test")
        got, want = backend.decode_image(img, LIMITS, target), ThreadDecodeBackend().decode_image(img, LIMITS, target)
        assert torch.equal(got.pixels, want.pixels) and got.source_format == want.source_format
    assert_no_blocks(backend)


def test_errors_cross_the_process_boundary_without_a_leak(backend):
    broken = MediaItem(MediaKind.IMAGE, "png", image_bytes(size=(64, 64))[:60], "test")
    with pytest.raises(UndecodableMediaError, match="png"):
        backend.decode_image(broken, LIMITS)
    info, indices = chunk_args(VIDEO)
    with pytest.raises(MediaTooLarge):  # the worker checks the chunk before it allocates
        backend.decode_chunk(VIDEO, info, indices, [0, 1], 2, MediaLimits(max_frames=3), (32, 48))
    with pytest.raises(MediaTooLarge):
        backend.decode_chunk(VIDEO, info, indices, [0], 2, MediaLimits(max_decoded_bytes_in_flight=1000), (32, 48))
    assert_no_blocks(backend)


def test_worker_refuses_a_huge_declared_frame_before_allocating():
    info, indices = chunk_args(VIDEO)
    big = MediaLimits(max_pixels=96 * 64 - 1)  # the source frames are over, whatever the output size
    name = "mmsd_test_never_created"
    with pytest.raises(MediaTooLarge):
        worker_jobs.chunk_job(name, -1, None, ("unused", 0), VIDEO, info, indices, [0], 2, big, (8, 8), 1)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


def test_cancellation_stops_the_worker_and_leaves_no_block(backend):
    info, indices = chunk_args(LONG)
    control = DecodeControl(30.0)
    threading.Timer(0.2, control.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(DecodeCancelled):
        backend.decode_chunk(LONG, info, list(range(600)), list(range(300)), 2, LIMITS, (240, 320), control)
    assert time.monotonic() - t0 < 20
    deadline = DecodeControl(0.2)
    with pytest.raises(MediaTooLarge, match="decode_timeout_s"):
        backend.decode_chunk(LONG, info, list(range(600)), list(range(300)), 2, LIMITS, (240, 320), deadline)
    assert_no_blocks(backend)


def _crash_job(name: str, *_args) -> tuple[int, ...]:
    # the worker's block exists, then the worker dies: the parent must still unlink it
    shared_memory.SharedMemory(name=name, create=True, size=1024).close()
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def _slow_job(name: str, *_args) -> tuple[int, ...]:
    time.sleep(1.0)
    return worker_jobs.publish(name, torch.full((2, 3), 7, dtype=torch.uint8))


def test_worker_crash_fails_only_its_job_and_the_pool_recovers(backend):
    results: dict[str, object] = {}

    def run(key: str, job) -> None:
        try:
            results[key] = backend._call(job, (VIDEO,), None, key)
        except Exception as exc:  # noqa: BLE001 - the test looks at what came back
            results[key] = exc

    slow = threading.Thread(target=run, args=("slow", _slow_job))
    slow.start()
    time.sleep(0.3)  # the slow job is running when its pool breaks
    run("crash", _crash_job)
    slow.join()
    assert isinstance(results["crash"], DecodeWorkerDied) and "crashes the decoder" in str(results["crash"]), results
    assert torch.equal(results["slow"], torch.full((2, 3), 7, dtype=torch.uint8))
    assert backend.restarts >= 2
    info, indices = chunk_args(VIDEO)  # the pool decodes again
    assert torch.equal(backend.decode_chunk(VIDEO, info, indices, [0], 2, LIMITS, (32, 48)),
                       ThreadDecodeBackend().decode_chunk(VIDEO, info, indices, [0], 2, LIMITS, (32, 48)))
    assert_no_blocks(backend)


def test_shutdown_with_jobs_in_flight_leaves_nothing():
    b = ProcessDecodeBackend(1)
    board = b._board.name
    info, _ = chunk_args(LONG)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            b.decode_chunk(LONG, info, list(range(600)), list(range(100)), 2, LIMITS, (240, 320))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    b.shutdown()
    for t in threads:
        t.join(30)
    assert all(not t.is_alive() for t in threads)
    assert all("shut down" in str(e) for e in errors)
    assert_no_blocks(b)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=board)


class _FrameCount:
    """A decode control that counts decoded frames (``check`` runs once per frame)."""

    def __init__(self) -> None:
        self.frames = 0

    def check(self) -> None:
        self.frames += 1


def test_groups_are_handed_on_as_they_decode(backend):
    """``on_group`` gets each group's frames, in order, equal to the chunk's rows; the thread
    backend calls it while the chunk still decodes (the first group long before the last frame),
    the process backend once the chunk is back. A padded tail (a repeated last frame) included."""
    info, indices = chunk_args(VIDEO)
    groups = list(range(len(indices) // 2))
    padded = [*indices[:-1], indices[-2]]  # the last group repeats a frame, as a padded tail does
    for idx in (list(indices), padded):
        want = ThreadDecodeBackend().decode_chunk(VIDEO, info, idx, groups, 2, LIMITS, (32, 48))
        for b in (ThreadDecodeBackend(), backend):
            count = _FrameCount() if b.streams_groups else None  # a process takes no such control
            seen = []
            whole = b.decode_chunk(VIDEO, info, idx, groups, 2, LIMITS, (32, 48), count,
                                   on_group=lambda g, f: seen.append((g, f.clone(), count and count.frames)))
            assert [g for g, _, _ in seen] == groups
            assert torch.equal(torch.cat([f for _, f, _ in seen]), whole) and torch.equal(whole, want)
            if b.streams_groups:
                assert seen[0][2] < seen[-1][2]  # the first group left before the last one decoded
    assert_no_blocks(backend)


def input_blocks_of(b: ProcessDecodeBackend) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/{b.prefix}_in*"))


def test_a_hold_keeps_one_copy_of_the_bytes_for_chunks_that_do_not_overlap(backend, monkeypatch):
    """Without a hold, each job that finds no other job of its item in flight copies the bytes into
    a new block (and the worker copies them out again); under ``hold`` the chunks of one video
    decoded one after another share the first job's block, and leaving the hold removes it."""
    info, indices = chunk_args(VIDEO)
    chunks = [[0], [1, 2], [len(indices) // 2 - 1]]
    want = [ThreadDecodeBackend().decode_chunk(VIDEO, info, indices, g, 2, LIMITS, (32, 48)) for g in chunks]
    made = []
    real = shared_memory.SharedMemory

    def counting(*args, **kwargs):
        block = real(*args, **kwargs)
        if kwargs.get("create") and "_in" in block.name:
            made.append(block.name)
        return block

    monkeypatch.setattr(shared_memory, "SharedMemory", counting)  # the parent's blocks (the backend's module)
    freed_on = []
    real_free = input_blocks._free
    monkeypatch.setattr(input_blocks, "_free", lambda block: (freed_on.append(threading.current_thread()),
                                                              real_free(block)))
    for g, w in zip(chunks, want):  # no hold: a block per chunk
        assert torch.equal(backend.decode_chunk(VIDEO, info, indices, g, 2, LIMITS, (32, 48)), w)
        assert input_blocks_of(backend) == []
    assert len(made) == len(chunks)
    made.clear()
    with backend.hold(VIDEO):
        assert input_blocks_of(backend) == []  # nothing is copied before a job needs it
        seen = []
        for g, w in zip(chunks, want):
            assert torch.equal(backend.decode_chunk(VIDEO, info, indices, g, 2, LIMITS, (32, 48)), w)
            seen.append(input_blocks_of(backend))
        assert len(made) == 1 and all(s == [f"/dev/shm/{made[0]}"] for s in seen)
    deadline = time.monotonic() + 10  # leaving the hold frees the block on a thread of its own
    while input_blocks_of(backend) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_no_blocks(backend)
    # a job frees its block on its own (worker) thread, here the caller's; leaving the hold, which
    # the producer does on the event loop, frees it on another thread
    assert freed_on[:len(chunks)] == [threading.current_thread()] * len(chunks)
    assert len(freed_on) == len(chunks) + 1 and freed_on[-1] is not threading.current_thread()
    with ThreadDecodeBackend().hold(VIDEO):  # the thread backend keeps nothing
        pass


def test_shutdown_with_a_hold_open_leaves_nothing():
    b = ProcessDecodeBackend(1)
    info, indices = chunk_args(VIDEO)
    hold = b.hold(VIDEO)
    hold.__enter__()
    b.decode_chunk(VIDEO, info, indices, [0], 2, LIMITS, (32, 48))
    assert len(input_blocks_of(b)) == 1
    b.shutdown()
    assert_no_blocks(b)
    hold.__exit__(None, None, None)  # the hold ends after the backend: nothing left to remove, no error
    assert_no_blocks(b)


def test_a_hold_loads_nothing_on_the_callers_thread(backend):
    """The producer enters and leaves its hold on the event loop: a deferred item's bytes (a data URL
    to decode, a file to read) load on the worker thread of the first job, not there."""
    loaded_on = []
    item = DeferredMediaItem(MediaKind.VIDEO, "mp4", lambda: loaded_on.append(threading.current_thread()) or VIDEO.data,
                             "test")
    info, indices = chunk_args(VIDEO)
    with backend.hold(item):
        assert not item.loaded
        got = []
        worker = threading.Thread(target=lambda: got.extend(
            backend.decode_chunk(item, info, indices, [g], 2, LIMITS, (32, 48)) for g in (0, 1)))
        worker.start()
        worker.join(60)
        assert loaded_on == [worker] and len(input_blocks_of(backend)) == 1
        want = [ThreadDecodeBackend().decode_chunk(VIDEO, info, indices, [g], 2, LIMITS, (32, 48)) for g in (0, 1)]
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    deadline = time.monotonic() + 10
    while input_blocks_of(backend) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_no_blocks(backend)


def test_a_job_carries_neither_the_bytes_nor_the_early_decode(backend):
    """An item decoded while its bytes arrived keeps that decoder (threads, locks) in ``early``; its
    remaining chunks still go to the processes, which get a plain item without it."""
    item = dataclasses.replace(VIDEO, early=threading.Lock())  # an object of this process, not picklable
    info, indices = chunk_args(VIDEO)
    assert torch.equal(backend.decode_chunk(item, info, indices, [1], 2, LIMITS, (32, 48)),
                       ThreadDecodeBackend().decode_chunk(VIDEO, info, indices, [1], 2, LIMITS, (32, 48)))
    assert_no_blocks(backend)
