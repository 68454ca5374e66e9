"""Media for benchmarks/pipeline.py: 720p test videos and images made with PyAV / numpy, plain PyAV
decoding of every frame (the floor a served request is compared with), and the decode-scaling
measurement (1 / 2 / 4 workers, thread and process backends, and the default with codec threads)."""

from __future__ import annotations

import asyncio
import io
import time

import av
import numpy as np

from mm_pipeline.media.decode.backend import ProcessDecodeBackend, ThreadDecodeBackend
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.ingest import MediaLimits
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


def make_image(seed: int, size: tuple[int, int] = (96, 96)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ---- parallel decode --------------------------------------------------------------------------
DECODE_WORKERS = (1, 2, 4)


def bench_parallel_decode(video: bytes, reps: int) -> dict[str, float]:
    """The sampled frames of one clip (2 frames/s) decoded as the server does it: chunks of 2 frame
    groups (video_chunks.plan_chunks), each from its own seek point, on a WorkerPool of 1 / 2 / 4
    workers, with the thread backend and with the process backend (frames back through shared
    memory), codec threads off so the workers are the only parallelism; plus the server's default
    (2 worker threads, FFmpeg's codec threads on) and plain PyAV decoding every frame as the floor.
    Runs interleave; medians of ``reps``."""
    item = MediaItem(MediaKind.VIDEO, "mp4", video, "bench")
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, VideoSamplingParams(fps=2.0, max_frames=3600))
    tp = 2
    chunks = plan_chunks(list(range(len(sampling.indices) // tp)), sampling.indices, info.keyframes, tp, 2)
    size = (info.height, info.width)
    processes = {w: ProcessDecodeBackend(w) for w in DECODE_WORKERS}
    variants = [("thread", w, 1) for w in DECODE_WORKERS] + [("process", w, 1) for w in DECODE_WORKERS]
    variants.append(("default", 2, 0))

    async def decode(kind: str, workers: int, threads: int) -> float:
        backend = processes[workers] if kind == "process" else ThreadDecodeBackend()
        pool = WorkerPool(max_workers=workers, max_pending=len(chunks))
        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(pool.run(backend.decode_chunk, item, info, sampling.indices, c, tp, MediaLimits(),
                                            size, None, threads) for c in chunks))
            return time.perf_counter() - t0
        finally:
            pool.shutdown()

    times: dict[tuple[str, int, int], list[float]] = {v: [] for v in variants}
    floor = []
    try:
        for backend in processes.values():
            backend.warm()
        for _ in range(reps):
            for v in variants:
                times[v].append(asyncio.run(decode(*v)))
            floor.append(pyav_decode_all(video))
    finally:
        for backend in processes.values():
            backend.shutdown()
    med = {v: float(np.median(t)) for v, t in times.items()}
    out = {f"decode_{k}_{w}_s": s for (k, w, t), s in med.items() if k != "default"}
    out["decode_default_s"] = med["default", 2, 0]
    out["pyav_all_frames_s"] = float(np.median(floor))
    for kind, key in (("thread", "parallel_decode_speedup"), ("process", "process_decode_speedup")):
        out[key] = med[kind, 1, 1] / med[kind, 2, 1]
        out[f"{key}_4"] = med[kind, 1, 1] / med[kind, 4, 1]
    out["process_over_thread_2"] = med["process", 2, 1] / med["thread", 2, 1]  # < 1: processes faster
    out["decode_default_speedup"] = med["thread", 1, 1] / med["default", 2, 0]
    out["decode_chunks"] = float(len(chunks))
    return out


def decode_table(results: dict[str, float]) -> list[tuple]:
    """Rows of the 1 / 2 / 4 worker table: workers, thread s, process s, speed-ups over 1 worker."""
    rows = []
    for w in DECODE_WORKERS:
        t, p = results[f"decode_thread_{w}_s"], results[f"decode_process_{w}_s"]
        rows.append((w, t, p, results["decode_thread_1_s"] / t, results["decode_process_1_s"] / p))
    return rows


def pyav_decode_all(video: bytes) -> float:
    """Seconds plain PyAV needs to decode every frame (FFmpeg's own threading on): the floor."""
    t0 = time.perf_counter()
    with av.open(io.BytesIO(video)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for _ in container.decode(stream):
            pass
    return time.perf_counter() - t0


# ---- encoder batching -------------------------------------------------------------------------
