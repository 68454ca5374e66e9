"""Encoder throughput: packed batches vs one item at a time, and MFU against this machine's matmul.

    .venv/bin/python benchmarks/encoder_throughput.py --quick --json /tmp/encoders.json

Measures (fp32, pixel/mel preprocessing excluded -- the encoders' device work only):
  * images/s for mixed-size small (<= 256 px) and large images, batches 1..32;
  * frame groups/s for a video (all groups in one call vs one group per call);
  * audio seconds/s for mixed clip lengths;
  * achieved GFLOP/s of the batched vision forward / fp32 matmul GFLOP/s measured in the same run.
A mid-size tower (hidden 512) is used so that matmuls, not Python, dominate, as in the real model.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import argparse
import json
import random
from typing import Callable, Sequence

import torch
from _common import best_time, matmul_rate

from encoders.audio.encoder import AudioEncoder
from encoders.config import AudioConfig, VisionConfig
from encoders.image_processing import ImageProcessingConfig, preprocess_image
from samples.checkpoints.tiny_towers import init_random_
from encoders.video import preprocess_video
from encoders.vision.tower import VisionTransformer


def vision_config(depth: int) -> VisionConfig:
    # The real layout pattern, shortened: full, row windows, column windows, ..., full.
    types = [-1] + [0, 1] * ((depth - 2) // 2) + [0] * ((depth - 2) % 2) + [-1]
    return VisionConfig(depth=depth, hidden_size=512, intermediate_size=1536, num_heads=8, num_key_value_heads=2,
                        head_dim=64, out_hidden_size=1024, window=64, vit_window_attn_types=tuple(types),
                        fullatt_block_indexes=(0, depth - 1))


def vision_flops(cfg: VisionConfig, grids: Sequence[tuple[int, int, int]]) -> float:
    """Useful FLOPs: every matmul, attention over exactly the visible keys (band clipped at edges)."""
    hid, d = cfg.hidden_size, cfg.head_dim
    per_token_linear = 2 * (cfg.patch_dim * hid + cfg.depth * (hid * cfg.qkv_size + cfg.num_heads * d * hid
                                                                + 3 * hid * cfg.intermediate_size))
    per_token_linear += 2 * (cfg.merge_unit * hid * cfg.merge_unit * hid + cfg.merge_unit * hid * cfg.out_hidden_size) \
        / cfg.merge_unit
    total = 0.0
    for t, h, w in grids:
        n = h * w
        band_pairs = sum(min(n - 1, i + cfg.window) - max(0, i - cfg.window) + 1 for i in range(n))
        for kind in cfg.block_kinds:
            pairs = n * n if kind == "full" else band_pairs
            total += t * pairs * 4 * d * cfg.num_heads
        total += t * n * per_token_linear
    return total


def image_items(count: int, lo: int, hi: int, seed: int):
    rng = random.Random(seed)
    proc = ImageProcessingConfig(min_pixels=32 * 32, max_pixels=hi * hi)
    items = []
    for _ in range(count):
        h, w = rng.randint(lo, hi), rng.randint(lo, hi)
        items.append(preprocess_image(torch.rand(3, h, w) * 255, proc))
    return items


def bench_batches(encode: Callable[[list], object], items: list, batches: Sequence[int], reps: int,
                  units: Callable[[list], float]) -> dict[int, tuple[float, float, float]]:
    """Per batch size: (units/s batched in one call, units/s one item per call, CPU-time speedup).
    The two modes are timed alternately, best of ``reps``, so outside load hits both alike."""
    encode(items[:1])  # warm-up
    out = {}
    for b in batches:
        part = items[:b]
        encode(part)  # first call of a new total shape pays allocator / kernel-selection costs
        batched = single = (float("inf"), float("inf"))
        for _ in range(reps):
            batched = tuple(map(min, batched, best_time(lambda: encode(part), 1)))
            single = tuple(map(min, single, best_time(lambda: [encode([x]) for x in part], 1)))
        out[b] = (units(part) / batched[0], units(part) / single[0], single[1] / batched[1])
    return out


def record(res: dict, rows: list, name: str, key: str, stats: dict) -> tuple[float, float, float]:
    """Add table rows and per-batch keys; return the largest batch's stats."""
    for b, (batched, single, speedup_cpu) in stats.items():
        rows.append((name, b, batched, single, speedup_cpu))
        res[f"{key}_per_s_b{b}"] = batched
    b_max = max(stats)
    return stats[b_max]


def bench_vision(res: dict, rows: list, quick: bool, reps: int, peak: tuple[float, float]) -> VisionTransformer:
    cfg = vision_config(4 if quick else 8)
    tower = init_random_(VisionTransformer(cfg)).eval()
    count = lambda part: float(len(part))
    small = image_items(32, 32, 160 if quick else 256, seed=1)
    large = image_items(2 if quick else 16, 320 if quick else 384, 384 if quick else 768, seed=2)
    for name, items, batches in (("small", small, (1, 8, 32) if quick else (1, 4, 16, 32)),
                                 ("large", large, (1, 2) if quick else (1, 4, 16))):
        stats = bench_batches(tower.encode_items, items, batches, reps, count)
        batched, single, speedup_cpu = record(res, rows, f"vision {name} images/s", f"vision_{name}_images", stats)
        res[f"vision_batched_speedup_{name}"] = batched / single
        res[f"vision_batched_speedup_{name}_cpu"] = speedup_cpu
    # MFU: the batched large-image forward against the GEMM rate, measured alternately.
    peak_wall, peak_cpu = peak
    wall = cpu = float("inf")
    for _ in range(reps):
        pw, pc = matmul_rate(1)
        peak_wall, peak_cpu = max(peak_wall, pw), max(peak_cpu, pc)
        w, c = best_time(lambda: tower.encode_items(large), 1)
        wall, cpu = min(wall, w), min(cpu, c)
    flops = vision_flops(cfg, [g for _, g in large])
    res.update(matmul_gflops=peak_wall, matmul_gflops_per_cpu_s=peak_cpu, vision_gflops=flops / wall / 1e9,
               vision_mfu=flops / wall / 1e9 / peak_wall, vision_mfu_cpu=flops / cpu / 1e9 / peak_cpu)

    frames = torch.rand(8 if quick else 32, 3, 240, 320) * 255
    video = preprocess_video(frames, [float(i) for i in range(frames.shape[0])],
                             ImageProcessingConfig(video_max_pixels=320 * 240))
    groups = video.groups()
    stats = bench_batches(tower.encode_items, groups, (len(groups),), reps, count)
    batched, single, speedup_cpu = record(res, rows, "video frame groups/s", "video_groups", stats)
    res["video_batched_speedup"], res["video_batched_speedup_cpu"] = batched / single, speedup_cpu
    return tower


def bench_audio(res: dict, rows: list, quick: bool, reps: int) -> None:
    cfg = AudioConfig(d_model=512, num_layers=4, num_heads=8, ffn_dim=2048,
                      layer_types=("sliding", "full", "sliding", "full"), attention_window=64,
                      projection_hidden_size=2048, out_hidden_size=1024)
    audio = init_random_(AudioEncoder(cfg)).eval()
    rng = random.Random(3)
    clips = [torch.randn(cfg.num_mel_frames(int(rng.uniform(0.5, 2.0 if quick else 12) * cfg.sampling_rate)),
                         cfg.n_mels) for _ in range(32)]
    seconds = lambda part: sum(m.shape[0] for m in part) / cfg.frames_per_second
    stats = bench_batches(audio, clips, (1, 8, 16) if quick else (1, 4, 16, 32), reps, seconds)
    batched, single, speedup_cpu = record(res, rows, "audio seconds/s", "audio_seconds", stats)
    res["audio_batched_speedup"], res["audio_batched_speedup_cpu"] = batched / single, speedup_cpu


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, < 60 s")
    ap.add_argument("--json", type=str, default=None, help="write the flat result dict here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    reps = 2 if args.quick else 3
    res: dict[str, float] = {"threads": torch.get_num_threads()}
    rows: list = []
    with torch.no_grad():
        peak = matmul_rate(reps)
        bench_vision(res, rows, args.quick, reps, peak)
        bench_audio(res, rows, args.quick, reps)
    print(f"{'workload':<24}{'batch':>6}{'batched':>11}{'one-by-one':>12}{'speedup':>9}{'(cpu)':>7}")
    for name, b, batched, single, speedup_cpu in rows:
        print(f"{name:<24}{b:>6}{batched:>11.2f}{single:>12.2f}{batched / single:>9.2f}{speedup_cpu:>7.2f}")
    print(f"fp32 matmul {res['matmul_gflops']:.1f} GFLOP/s; vision batched {res['vision_gflops']:.1f} GFLOP/s; "
          f"MFU {res['vision_mfu']:.2f} (by CPU time {res['vision_mfu_cpu']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    return res


if __name__ == "__main__":
    main()
