"""One video frame group through preprocessing and the vision tower, and a long clip's chunk decode:
the fast paths next to what they replaced, side by side in one run (CPU time, medians of repeats).

    .venv/bin/python benchmarks/frame_group.py --quick --json /tmp/frame_group.json

Keys (per frame group, one intra-op thread, CPU ms from ``time.thread_time``):
  {bench,demo}_preprocess_{rows,float}_ms  uint8 patchify + normalised rows (the default) / float
                                   frames normalised first (what resized images still take)
  {bench,demo}_tower_{cached,uncached}_ms  the tower with its per-grid geometry cache / with the
                                   cache emptied before each call (index tensors and RoPE tables
                                   built once per forward, as before the cache)
  {bench,demo}_tower_explicit_sinks_ms  the cached tower with the windowed blocks' sink attention on
                                   explicit fp32 logits (before the fused flash path, FUSED_SINKS off)
  {bench,demo}_*_speedup           the second / the first (sinks: explicit / fused)
  decode_{shared,ffmpeg}_{wall,cpu}_s  the chunks of a 720p clip (one frame group each, the demo
                                   model's sampling) on two worker threads, codec threads as the
                                   runtime resolves ``--decoder-threads 0`` now (CPUs // workers) /
                                   FFmpeg's automatic count (CPUs + 1); process CPU time
"bench" is the benchmark checkpoint of benchmarks/pipeline.py (160x288 groups), "demo" the demo
model (samples/demo-model, 96x192 groups).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from _common import base_parser, print_table, write_json
from _pipeline_media import HD, make_video
from encoders.image_processing import normalize, patchify
from encoders.vision.geometry_cache import GeometryCache
from kernels import band_attention_ref
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.media.decode.decoder_memory import codec_threads, shared_codec_threads
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.decode.video_chunks import decode_chunk, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.model.omni_model import OmniModel

DEMO = Path(__file__).resolve().parents[1] / "samples" / "demo-model"


def cpu_ms(fn: Callable[[], object], n: int) -> float:
    for _ in range(3):
        fn()
    t = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t) / n * 1e3


def bench_group(name: str, model_dir: Path, reps: int, n: int) -> dict[str, float]:
    """Both variants of each step take turns in every repetition, so load bursts hit both."""
    model = OmniModel.load(model_dir, with_text=False)
    tower = model.vision
    pre = Preprocessor(model.image_config)
    size = pre.video_size(720, 1280, 16)
    frames = torch.randint(0, 256, (2, *size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    c = model.image_config

    def float_rows() -> torch.Tensor:
        x = normalize(frames.permute(0, 3, 1, 2).float(), c.mean, c.std)
        return patchify(x, c.patch_size, c.temporal_patch_size, c.merge_size)[0].contiguous()

    group = pre.video_groups(frames, size)[0]
    assert torch.equal(group.rows, float_rows())
    items = [(group.rows, group.grid)]
    cached = tower.geometry
    # emptied before every call: each forward builds its geometry once, as before the cache
    uncached = GeometryCache(cached.merge, cached.head_dim, cached.theta)

    def run_tower(cache: GeometryCache) -> float:
        tower.geometry = cache
        try:
            return cpu_ms(lambda: (cache is uncached and cache.clear(), tower.encode_items(items)), n)
        finally:
            tower.geometry = cached

    def run_explicit_sinks() -> float:
        band_attention_ref.FUSED_SINKS = False
        try:
            return run_tower(cached)
        finally:
            band_attention_ref.FUSED_SINKS = True

    runs: dict[str, list[float]] = {k: [] for k in ("preprocess_rows", "preprocess_float", "tower_cached",
                                                     "tower_uncached", "tower_explicit_sinks")}
    for _ in range(reps):
        runs["preprocess_rows"].append(cpu_ms(lambda: pre.video_groups(frames, size), n))
        runs["preprocess_float"].append(cpu_ms(float_rows, n))
        runs["tower_cached"].append(run_tower(cached))
        runs["tower_uncached"].append(run_tower(uncached))
        runs["tower_explicit_sinks"].append(run_explicit_sinks())
    out = {f"{name}_{k}_ms": statistics.median(v) for k, v in runs.items()}
    out[f"{name}_preprocess_speedup"] = out[f"{name}_preprocess_float_ms"] / out[f"{name}_preprocess_rows_ms"]
    out[f"{name}_tower_speedup"] = out[f"{name}_tower_uncached_ms"] / out[f"{name}_tower_cached_ms"]
    out[f"{name}_tower_sinks_speedup"] = out[f"{name}_tower_explicit_sinks_ms"] / out[f"{name}_tower_cached_ms"]
    return out


def bench_decode(seconds: int, reps: int) -> dict[str, float]:
    video = make_video(seconds, **HD, seed=310)
    item = MediaItem(MediaKind.VIDEO, "mp4", video, "bench")
    limits = MediaLimits()
    info = probe_video(item, limits)
    params = VideoSamplingParams.from_processor_config(json.loads((DEMO / "config.json").read_text())["processor_config"])
    indices = sample_frames(info.total_frames, info.video_fps, params).indices
    chunks = plan_chunks(range(len(indices) // 2), indices, info.keyframes, 2, 1)
    settings = {"shared": shared_codec_threads(2), "ffmpeg": codec_threads(0, info.width * info.height)}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in settings}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(reps):
            for name, threads in settings.items():
                c0, w0 = time.process_time(), time.perf_counter()
                list(pool.map(lambda ch: decode_chunk(item, info, indices, ch, 2, limits, (96, 192), threads=threads),
                              chunks))
                runs[name].append((time.perf_counter() - w0, time.process_time() - c0))
    out: dict[str, float] = {"decode_chunks": len(chunks)}
    for name, threads in settings.items():
        out[f"decode_{name}_threads"] = threads
        out[f"decode_{name}_wall_s"] = statistics.median(w for w, _ in runs[name])
        out[f"decode_{name}_cpu_s"] = statistics.median(c for _, c in runs[name])
    out["decode_shared_cpu_saving"] = out["decode_ffmpeg_cpu_s"] / out["decode_shared_cpu_s"]
    out["decode_shared_wall_speedup"] = out["decode_ffmpeg_wall_s"] / out["decode_shared_wall_s"]
    return out


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    reps, n = (3, 40) if args.quick else (5, 100)
    from _bench_omni import build_model  # the pipeline benchmarks' checkpoint

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results.update(bench_group("bench", build_model(Path(tmp)), reps, n))
    if (DEMO / "config.json").is_file():
        results.update(bench_group("demo", DEMO, reps, n))
    results.update(bench_decode(20 if args.quick else 60, reps))
    rows = [(k, v) for k, v in results.items()]
    print_table(f"frame group and chunk decode (medians of {reps})", ["metric", "value"], rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
