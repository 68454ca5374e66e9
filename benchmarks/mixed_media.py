"""An image request sent while a long video is being decoded: its time to first token, per queue order.

    .venv/bin/python benchmarks/mixed_media.py [--quick] [--repeat 3] [--json out.json]

A fresh 60 s 720p H.264 clip (``--quick``: 40 s) is asked about; 300 ms later, while its chunk
decodes fill the media worker pool and its frame groups the encoder queue, a fresh 640x480 image is
asked about. Reported per mode (medians over ``--repeat`` rounds, the modes alternating within each
round on one engine): the image's time to first token, the video's, and the image's alone (no video
in flight) for reference.

Modes: the media worker pool's order (media/worker_pool.py) and the encoder queue's
(encode/batcher.py, ``--encoder-batch-order``):
- ``fair`` (the default): requests take turns in the pool, a spare thread starts the calls of a
  request with none running, and in the encoder queue (the image's unit batched apart from the
  video's frame groups on this CPU encoder);
- ``encoder arrival``: the pool as the default, the encoder queue in arrival order;
- ``pool no spare``: the default without the spare thread (``--decode-spare-workers 0``);
- ``fifo``: one queue for every request's calls in the pool, no spare, the encoder queue in
  arrival order (before requests took turns): the image's ingest, plan, cache lookup and decode each
  wait behind every chunk the video queued first, its unit behind the frame groups queued first.

One engine serves all modes: the spare thread stays idle where ``pool.spare`` is 0, ``fifo`` puts
every call in one flow, and the batcher's config is swapped. Each trial's media are cold: a cache
salt of its own keys the encoder cache, the ingest memos and the prefix cache apart. Model:
``pipeline.py``'s (ViT hidden 256, text hidden 256 MoE), fp32, 2 decode workers.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import contextlib
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from _common import base_parser, new_engine, print_table, write_json
from _pipeline_media import make_h264, make_image
from _bench_omni import ONE_TOKEN, ask, build_model, data_part, engine_config

import mm_pipeline.runtime.omni_engine as omni_engine

MODES = ("fair", "encoder arrival", "pool no spare", "fifo")
IMAGE_SIZE = (640, 480)
VIDEO_LEAD_S = 0.3  # the video's head start: its chunk decodes are queued and running by then


async def _ttft(engine, messages: list[dict], salt: str) -> float:
    t0 = time.perf_counter()
    async for _ in engine.generate(messages, ONE_TOKEN, cache_salt=salt):
        return time.perf_counter() - t0
    raise RuntimeError("no output")


@contextlib.contextmanager
def _mode(engine, mode: str):
    pool, flow, batcher = engine.runtime.pool, omni_engine.pool_flow, engine.runtime.batcher
    spare, config = pool.spare, batcher.config
    pool.spare = 0 if mode in ("pool no spare", "fifo") else spare
    if mode == "fifo":  # every request's calls in one flow: the pool's order is arrival order
        omni_engine.pool_flow = lambda *_: contextlib.nullcontext()
    if mode in ("encoder arrival", "fifo"):
        batcher.config = dataclasses.replace(config, order="arrival")
    try:
        yield
    finally:
        pool.spare, omni_engine.pool_flow, batcher.config = spare, flow, config


def trial(engine, video: dict, image: dict, salt: str) -> tuple[float, float]:
    """(image ttft, video ttft) with the image sent VIDEO_LEAD_S after the video."""
    async def both() -> tuple[float, float]:
        v = asyncio.create_task(_ttft(engine, video, salt))
        await asyncio.sleep(VIDEO_LEAD_S)
        i = await _ttft(engine, image, salt)
        return i, await v

    return asyncio.run(both())


def run(quick: bool, repeat: int) -> tuple[dict, dict[str, str]]:
    seconds = 40 if quick else 60
    with tempfile.TemporaryDirectory() as tmp:
        engine = new_engine(build_model(Path(tmp)), engine_config(enable_prefix_caching=True))
        try:
            video = ask(data_part("video", make_h264(seconds, seed=7)), "Describe the video.")
            image = ask(data_part("image", make_image(8, size=IMAGE_SIZE)), "What is in the picture?")
            asyncio.run(_ttft(engine, ask(data_part("video", make_h264(2, seed=1)), "warm up"), "warm"))
            asyncio.run(_ttft(engine, ask(data_part("image", make_image(2, size=IMAGE_SIZE)), "warm up"), "warm"))
            alone = [asyncio.run(_ttft(engine, image, f"alone-{r}")) for r in range(repeat)]
            got: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
            for r in range(repeat):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    with _mode(engine, mode):
                        got[mode].append(trial(engine, video, image, f"{mode}-{r}"))
                    engine.runtime.pool.check_integrity()
        finally:
            engine.shutdown()
    runs: dict[str, str] = {}  # each mode's image ttft per round, for the table
    out: dict = {"video_seconds": seconds, "repeat": repeat, "image_alone_ttft_ms": statistics.median(alone) * 1e3}
    for mode, rows in got.items():
        key = mode.replace(" ", "_")
        out[f"{key}_image_ttft_ms"] = statistics.median(i for i, _ in rows) * 1e3
        out[f"{key}_image_ttft_min_ms"] = min(i for i, _ in rows) * 1e3
        out[f"{key}_image_ttft_max_ms"] = max(i for i, _ in rows) * 1e3
        runs[mode] = " ".join(f"{i * 1e3:.0f}" for i, _ in rows)
        out[f"{key}_video_ttft_ms"] = statistics.median(v for _, v in rows) * 1e3
    out["fifo_over_fair_image"] = out["fifo_image_ttft_ms"] / out["fair_image_ttft_ms"]
    out["encoder_arrival_over_fair_image"] = out["encoder_arrival_image_ttft_ms"] / out["fair_image_ttft_ms"]
    return out, runs


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians reported)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    out, runs = run(args.quick, args.repeat)
    rows = [(mode, out[f"{mode.replace(' ', '_')}_image_ttft_ms"], runs[mode],
             out[f"{mode.replace(' ', '_')}_video_ttft_ms"]) for mode in MODES]
    rows.append(("image alone", out["image_alone_ttft_ms"], "", float("nan")))
    print_table(f"image behind a {out['video_seconds']} s 720p H.264 video, medians of {out['repeat']} (ms)",
                ["queue order", "image ttft", "runs", "video ttft"], rows)
    print(f"image ttft: fifo / fair {out['fifo_over_fair_image']:.2f}x, encoder arrival / fair "
          f"{out['encoder_arrival_over_fair_image']:.2f}x")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
