"""Media for benchmarks/pipeline.py: 720p test videos and images made with PyAV / numpy, plain PyAV
decoding of every frame (the floor a served request is compared with), and the decode-scaling
measurement (1 / 2 / 4 worker threads, with and without FFmpeg's codec threads)."""

from __future__ import annotations

import asyncio
import io
import time

import av
import numpy as np

from mm_pipeline.media.decode_video import VideoDecoder
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.media.video_sampling import VideoSamplingParams
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
def bench_parallel_decode(video: bytes, reps: int) -> dict[str, float]:
    """Sampled-frame decode of one clip with 1 / 2 / 4 worker threads (one range each), with the
    codec's own threads off (``_nothreads``, decoder_threads=1) and on (decoder_threads=0, the
    default), and plain PyAV decoding every frame as the floor. Runs interleave; best of ``reps``."""
    item = MediaItem(MediaKind.VIDEO, "mp4", video, "bench")
    sampling = VideoSamplingParams(fps=2.0, max_frames=3600)
    variants = [(w, t) for t in (1, 0) for w in (1, 2, 4)]
    best = {v: float("inf") for v in variants}

    async def decode(workers: int, threads: int) -> float:
        pool = WorkerPool(max_workers=workers, max_pending=16)
        try:
            t0 = time.perf_counter()
            await VideoDecoder(sampling, pool=pool, num_ranges=workers, threads=threads).decode(item)
            return time.perf_counter() - t0
        finally:
            pool.shutdown()

    floor = float("inf")
    for _ in range(reps):
        for v in variants:
            best[v] = min(best[v], asyncio.run(decode(*v)))
        floor = min(floor, pyav_decode_all(video))
    out = {f"decode_{w}_workers{'_nothreads' if t == 1 else ''}_s": s for (w, t), s in best.items()}
    out["pyav_all_frames_s"] = floor
    out["parallel_decode_speedup"] = best[1, 1] / best[2, 1]  # workers alone (codec threads off)
    out["parallel_decode_speedup_4"] = best[1, 1] / best[4, 1]
    out["decode_default_speedup"] = best[1, 1] / best[2, 0]  # the default (2 workers, codec threads) / 1 plain
    return out


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
