"""Media for benchmarks/pipeline.py: 720p test videos and images made with PyAV / numpy, plain PyAV
decoding of every frame (the floor a served request is compared with), the decode-scaling
measurement (1 / 2 / 4 workers, thread and process backends, and the default with codec threads)
and the sampled decode of an H.264 clip with its unsampled non-reference frames dropped or not."""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import io
import os
import threading
import time
from collections.abc import Sequence

import av
import numpy as np

from _common import print_table

from mm_pipeline.encode.plan import PlannerConfig
from mm_pipeline.media.decode.backend import ProcessDecodeBackend, ThreadDecodeBackend
from mm_pipeline.media.decode.video import decode_range, probe_video
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.media.decode.video_chunks import plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.worker_pool import WorkerPool

# ---- media ------------------------------------------------------------------------------------
# What phones record: 720p at 30 fps, a keyframe every 2 s. The model samples 1 frame per second,
# so decoding (all frames of every needed GOP) is a real share of the work, as in production.
HD = dict(fps=30, size=(1280, 720), gop=60)


def make_video(seconds: int, fps: int = 10, size: tuple[int, int] = (320, 240), gop: int | None = None,
               seed: int = 0) -> bytes:
    """An MPEG-4 part 2 clip (fast to encode) of noise with a moving square; a keyframe every
    ``gop`` frames (default: every second). ``seed`` changes the content (so the cache misses)."""
    w, h = size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.options = {"g": str(gop or fps), "bf": "0", "qscale": "4"}
        rng = np.random.default_rng(seed)
        noise = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
        for k in range(seconds * fps):
            img = noise + np.uint8((k * 3) % 190)
            x = (7 * k) % (w - 32)
            img[40:72, x:x + 32] = 255
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            frame.pts = k
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def make_h264(seconds: int, fps: int = 30, size: tuple[int, int] = (1280, 720), gop: int = 60,
              seed: int = 0) -> bytes:
    """A camera panning across a textured scene, coded as phones and web video are: H.264 (x264
    veryfast, CRF 23: B-frames, some of them references through the B-pyramid), a keyframe every
    ``gop`` frames. (On ``make_video``'s static noise x264's B-frames cost almost nothing to decode,
    so dropping them saved 1.16x; real footage moves.)"""
    w, h = size
    rng = np.random.default_rng(seed)
    scene = np.kron(rng.integers(0, 255, (h // 8 + 64, w // 8 + 64, 3), dtype=np.uint8), np.ones((8, 8, 1), np.uint8))
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.options = {"g": str(gop), "preset": "veryfast", "crf": "23"}
        for k in range(seconds * fps):
            x, y = (2 * k) % (scene.shape[1] - w), k % (scene.shape[0] - h)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(scene[y:y + h, x:x + w]), format="rgb24")
            frame.pts = k
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def make_image(seed: int, size: tuple[int, int] = (96, 96)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ---- parallel decode --------------------------------------------------------------------------
DECODE_WORKERS = (1, 2, 4)
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/<pid>/stat, clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15 of stat(5)


class WorkerCpu:
    """The wall time ``workers`` workers would take on a free core each, from the CPU time each
    chunk cost in this run: each chunk's cost, then the pool's own FIFO hand-out replayed on
    dedicated cores (a chunk goes to the worker that frees first). Per chunk: the pool thread's
    CPU time around the call (``time.thread_time``; codec threads off, so the decode runs on that
    thread) and, for the process backend, the worker processes' CPU time, shared among the chunks
    by their sampled frames (a process cannot say which chunk it spent it on). Replaying the
    hand-out, rather than taking the busiest worker's CPU, keeps a worker that the host starved
    (so the other took more chunks) from showing as poor scaling."""

    def __init__(self, backend: object, weights: Sequence[int]) -> None:
        self._pids = backend.worker_pids() if isinstance(backend, ProcessDecodeBackend) else []
        self._weights = list(weights)
        self._spent = [0.0] * len(weights)
        self._start = {pid: process_cpu_s(pid) for pid in self._pids}

    def timed(self, k: int, fn):
        def call(*args):
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                self._spent[k] += time.thread_time() - t0
        return call

    def makespan_s(self, workers: int) -> float:
        children = sum(process_cpu_s(p) - c for p, c in self._start.items())
        total = sum(self._weights)
        costs = [t + children * w / total for t, w in zip(self._spent, self._weights)]
        free = [0.0] * workers  # when each worker is free again
        for c in costs:
            heapq.heapreplace(free, free[0] + c)
        return max(free)


def control_speedup(seconds: float = 0.15) -> float:
    """Two threads of GIL-free work (sha256 over a buffer) vs one thread doing both halves: how
    many of the host's cores are free right now (2.0 on an idle 2-core host). Measured beside each
    decode round, it tells the box's share of a wall-clock ratio from the decoder's."""
    data = os.urandom(1 << 20) * 16  # 16 MiB; hashlib releases the GIL for large buffers

    def work() -> None:
        for _ in range(reps):
            hashlib.sha256(data).digest()

    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    reps = max(1, int(seconds / max(1e-4, time.perf_counter() - t0)))
    t0 = time.perf_counter()
    work()
    work()
    one = time.perf_counter() - t0
    threads = [threading.Thread(target=work) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return one / (time.perf_counter() - t0)


def bench_parallel_decode(video: bytes, reps: int) -> dict[str, float]:
    """The sampled frames of one clip (2 frames/s) decoded as the server does it: chunks as the
    engine's default cuts them (video_chunks.plan_chunks: one per GOP here), each from its own seek point, on a WorkerPool of 1 / 2 / 4
    workers, with the thread backend and with the process backend (frames back through shared
    memory), codec threads off so the workers are the only parallelism; plus the server's default
    (2 worker threads, FFmpeg's codec threads on) and plain PyAV decoding every frame as the floor.
    Runs interleave, a warm-up round first; medians of ``reps``.

    Two speed-ups per backend: from CPU time (one worker's CPU over the wall time N workers would
    take on a free core each, see ``WorkerCpu``: does the work split, whatever else runs on the host) and from wall time (what
    this host gave at that moment, next to ``control_speedup``: a busy second core makes two
    workers no faster than one, ~1.1x at nice 10 beside a nice-0 job, and that is the host)."""
    item = MediaItem(MediaKind.VIDEO, "mp4", video, "bench")
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, VideoSamplingParams(fps=2.0, max_frames=3600))
    tp = 2
    chunks = plan_chunks(list(range(len(sampling.indices) // tp)), sampling.indices, info.keyframes, tp,
                         PlannerConfig().groups_per_chunk)
    # frames leave swscale at the size the server asks for with pipeline.py's checkpoint (a 720p
    # clip: 160x288). Full-size RGB (2.7 MB a frame) made the table measure page faults: ~27k
    # per 20 s pass, their cost swinging the process backend's 1-worker time 0.75-1.0 s
    size = (160, 288)
    processes = {w: ProcessDecodeBackend(w) for w in DECODE_WORKERS}
    variants = [("thread", w, 1) for w in DECODE_WORKERS] + [("process", w, 1) for w in DECODE_WORKERS]
    variants.append(("default", 2, 0))

    async def decode(kind: str, workers: int, threads: int) -> tuple[float, float]:
        backend = processes[workers] if kind == "process" else ThreadDecodeBackend()
        pool = WorkerPool(max_workers=workers, max_pending=len(chunks))
        await asyncio.gather(*(pool.run(time.sleep, 0) for _ in range(workers)))  # threads started before the clock
        cpu = WorkerCpu(backend, [len(c) for c in chunks])
        try:
            with backend.hold(item):  # as the server's producer does: one copy of the bytes per video
                t0 = time.perf_counter()
                await asyncio.gather(*(pool.run(cpu.timed(k, backend.decode_chunk), item, info, sampling.indices, c,
                                                tp, MediaLimits(), size, None, threads) for k, c in enumerate(chunks)))
                return time.perf_counter() - t0, cpu.makespan_s(workers)
        finally:
            pool.shutdown()

    wall: dict[tuple[str, int, int], list[float]] = {v: [] for v in variants}
    cpu: dict[tuple[str, int, int], list[float]] = {v: [] for v in variants}
    floor, control = [], []
    try:
        for backend in processes.values():
            backend.warm()
        # round 0 warms up and is not counted; each round starts at another variant. In a fixed
        # order the 1-worker variant ran first, right after the process backends started (later:
        # after the process variants and the PyAV floor), and its chunks cost up to 2x their CPU
        # there (20 s clip: 0.66-0.80 vs 0.35 s when run again; 2 workers barely affected), which
        # read as a 2.4-3.2x speed-up
        for r in range(reps + 1):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                w, c = asyncio.run(decode(*v))
                if r:
                    wall[v].append(w)
                    cpu[v].append(c)
            if not r:
                continue
            floor.append(pyav_decode_all(video))
            control.append(control_speedup())
    finally:
        for backend in processes.values():
            backend.shutdown()
    med = {v: float(np.median(t)) for v, t in wall.items()}
    crit = {v: float(np.median(t)) for v, t in cpu.items()}
    out = {f"decode_{k}_{w}_s": s for (k, w, t), s in med.items() if k != "default"}
    out |= {f"decode_{k}_{w}_cpu_s": s for (k, w, t), s in crit.items() if k != "default"}
    out["decode_default_s"] = med["default", 2, 0]
    out["pyav_all_frames_s"] = float(np.median(floor))
    out["decode_control_speedup"] = float(np.median(control))
    for kind, key in (("thread", "parallel_decode_speedup"), ("process", "process_decode_speedup")):
        out[key] = crit[kind, 1, 1] / crit[kind, 2, 1]
        out[f"{key}_4"] = crit[kind, 1, 1] / crit[kind, 4, 1]
        out[f"{key}_wall"] = med[kind, 1, 1] / med[kind, 2, 1]
        out[f"{key}_wall_4"] = med[kind, 1, 1] / med[kind, 4, 1]
        # 1.0: two workers got out of the host all that GIL-free work got in the same rounds
        out[f"{key}_wall_vs_control"] = out[f"{key}_wall"] / out["decode_control_speedup"]
    out["process_over_thread_2"] = med["process", 2, 1] / med["thread", 2, 1]  # < 1: processes faster
    out["decode_default_speedup"] = med["thread", 1, 1] / med["default", 2, 0]
    out["decode_chunks"] = float(len(chunks))
    return out


class _Frames:
    """A decode control counting the frames a decoder produced (decode_range checks once per frame)."""

    def __init__(self) -> None:
        self.n = 0

    def check(self) -> None:
        self.n += 1


def bench_nonref_decode(video: bytes, reps: int) -> dict[str, float]:
    """The sampled frames (1 a second, the checkpoint's rate) of an H.264 clip with B-frames, by
    one decoder on this thread (one worker's work), unsampled non-reference frames dropped
    (``decode_range``'s default) vs decoded; alternating, medians of ``reps``; frames the decoder
    produced; plain PyAV decoding every frame beside it."""
    item = MediaItem(MediaKind.VIDEO, "mp4", video, "bench")
    info = probe_video(item)
    targets = sorted(set(sample_frames(info.total_frames, info.video_fps, VideoSamplingParams()).indices))
    size = (96, 192)  # frames leave swscale at the model's size, as in the server
    times: dict[bool, list[float]] = {True: [], False: []}
    frames: dict[bool, int] = {}
    floor = []
    for _ in range(reps):
        for drop in (True, False):
            counter = _Frames()
            t0 = time.thread_time()
            decode_range(item, info, targets, size=size, control=counter, drop_nonref=drop)
            times[drop].append(time.thread_time() - t0)
            frames[drop] = counter.n
        floor.append(pyav_decode_all_cpu(video)[1])
    drop_s, keep_s = float(np.median(times[True])), float(np.median(times[False]))
    return {"h264_sampled_decode_drop_cpu_s": drop_s, "h264_sampled_decode_keep_cpu_s": keep_s,
            "h264_nonref_drop_speedup": keep_s / drop_s, "h264_frames_decoded_drop": float(frames[True]),
            "h264_frames_decoded_keep": float(frames[False]), "h264_frames_total": float(info.total_frames),
            "h264_sampled_frames": float(len(targets)), "h264_pyav_all_frames_cpu_s": float(np.median(floor))}


def bench_decode(quick: bool) -> dict[str, float]:
    """Both decode measurements, on 60 s 720p clips (``quick``: 20 s, 2 repetitions instead of 3)."""
    seconds, reps = (20, 2) if quick else (60, 3)
    return {**bench_parallel_decode(make_video(seconds, **HD), reps), **bench_nonref_decode(make_h264(seconds), reps)}


def print_decode_table(results: dict[str, float]) -> None:
    print_table(f"decode scaling (medians; codec threads off; wall s, s from CPU time, speed-ups from each; "
                f"host's free cores by the control: {results['decode_control_speedup']:.2f}x)",
                ["workers", "threads s", "cpu s", "x wall", "x cpu", "processes s", "cpu s", "x wall", "x cpu"],
                decode_table(results))


def decode_table(results: dict[str, float]) -> list[tuple]:
    """Rows of the 1 / 2 / 4 worker table: workers, then per backend wall s, that time from CPU
    time, and the speed-ups over 1 worker from each."""
    rows = []
    for w in DECODE_WORKERS:
        row: list = [w]
        for kind in ("thread", "process"):
            t, c = results[f"decode_{kind}_{w}_s"], results[f"decode_{kind}_{w}_cpu_s"]
            row += [t, c, results[f"decode_{kind}_1_s"] / t, results[f"decode_{kind}_1_cpu_s"] / c]
        rows.append(tuple(row))
    return rows


def pyav_decode_all(video: bytes) -> float:
    """Seconds plain PyAV needs to decode every frame (FFmpeg's own threading on): the floor."""
    return pyav_decode_all_cpu(video)[0]


def pyav_decode_all_cpu(video: bytes) -> tuple[float, float]:
    """(wall s, CPU s of this process) for plain PyAV decoding every frame, FFmpeg's threads on."""
    c0, t0 = time.process_time(), time.perf_counter()
    with av.open(io.BytesIO(video)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for _ in container.decode(stream):
            pass
    return time.perf_counter() - t0, time.process_time() - c0


# ---- encoder batching -------------------------------------------------------------------------
