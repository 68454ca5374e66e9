"""Multimodal pipeline benchmark: streaming, caching, batching, parallel decode, event-loop lag.

    .venv/bin/python benchmarks/pipeline.py --quick --json /tmp/pipeline.json

    .venv/bin/python benchmarks/pipeline.py --quick --repeat 3   # medians of 3, with min and max
    .venv/bin/python benchmarks/pipeline.py --decode-only --repeat 3   # the decode-scaling table alone
    .venv/bin/python benchmarks/pipeline.py --repeat-only --quick --repeat 3   # cached-media TTFTs alone
    .venv/bin/python benchmarks/pipeline.py --long-video-only --quick --repeat 3   # cold long-video TTFTs alone
    .venv/bin/python benchmarks/pipeline.py --loop-lag-only --repeat 50   # event-loop lag alone, worst of 50 runs
    python3 benchmarks/pipeline.py --long-video-only --quick --device cuda   # the engines on a GPU (bf16; .ci/gpu)

Keys (goals on the 2-core CPU host in brackets):
  long_video_ttft_ratio      streamed TTFT / sequential (decode all -> encode all -> prefill)  [<= 0.6]
  encoder_worker_ttft_ratio  streamed TTFT, encoder on its own worker / inline on the engine thread
  encoder_split_ttft_ratio   the same with --encoder-threads 1 (the engine thread keeps the rest) / inline
  encoder_follow_ttft_ratio  streamed TTFT with --encoder-threads 0 (the encoder takes the CPUs the busy
                             decode workers leave, per batch, divided among its lanes; the LLM keeps
                             torch's setting) / the default
  encoder_lanes_ttft_ratio   streamed TTFT, the default (--encoder-lanes 2: two encoder threads at one
                             intra-op thread each on 2 cores, the second while a decode worker is idle,
                             the LLM the other half) / --encoder-lanes 1 (one encoder thread, it and the
                             LLM at torch's setting); one_lane_timeline_tail_s: that variant's tail
  no_stream_ttft_ratio       streamed TTFT / --no-stream-embeddings (every unit encoded before prefill)
  repeat_media_ttft_ratio    TTFT, cached media + new question / cold                         [<= 0.1]
  same_prefix_ttft_ratio     TTFT, same media and same prompt prefix / cold                   [<= 0.03]
  repeat_*_ms, repeat_steps  the fastest repeat's parts: before its first step, its steps, after (_repeat_parts.py)
  repeat_{engine,encoder}_threads  the intra-op threads each thread ran at (measured at start by default)
  encoder_batching_speedup   units/s, cross-request batched / one request per forward         [>= 1.5]
  parallel_decode_speedup    720p video decode, 2 worker threads / 1 (_4: 4 / 1), from CPU time:
                             one worker's CPU / two workers' time on a free core each (each
                             chunk's CPU, the pool's hand-out replayed)                        [>= 1.8]
  parallel_decode_speedup_wall  the same from wall time: what the host gave (a busy second core
                             makes it ~1); decode_control_speedup: GIL-free work, 2 threads / 1,
                             in the same rounds (the host's free cores); _wall_vs_control the ratio
  process_decode_speedup     the same with worker processes (decode_backend process; _wall too)
  decode_{thread,process}_N_s  wall seconds with N = 1 / 2 / 4 workers (_cpu_s: that time from
                             CPU time, as above); process_over_thread_2 the wall ratio
  h264_nonref_drop_speedup   one decoder's CPU for a 720p H.264 clip's sampled frames, non-reference frames
                             decoded / dropped (the default); h264_frames_decoded_{drop,keep} the frames
  max_loop_lag_ms            max event-loop lag under 32 concurrent media requests            [<= 50]
  loop_lag_control_max_lag_ms  the same window in another process (a bare 5 ms sleeper): lag there
                             is the machine's CPU starvation, not this process (_loop_lag.py)
  loop_lag_gc_max_pause_ms   longest garbage collection of this process in that window
  loop_lag_stalls_over_goal  stalls over 50 ms; each is printed with where every thread was during it
  timeline_*                 one cold long-video request: per stage (decode, encode, prefill) its
                             first start, last end, busy seconds and spans (prefill: LLM steps),
                             and pairwise overlap seconds; no_stream_timeline_* the same request
                             with --no-stream-embeddings
  timeline_tail_s            first token - end of the last decoded chunk: what streaming can shorten
                             (the decode before it is the same work either way); stream_tail_ratio:
                             streamed tail / --no-stream-embeddings tail
  served_*                   --served: TTFT and server-process CPU through `mmserve serve`, each
                             request paired with a plain-PyAV decode timed just before it, the
                             host's idle core-seconds; then the same demo engine in-process with
                             its stage timeline: served_stream_gain_ceiling, the most streaming
                             can gain over --no-stream-embeddings (benchmarks/_served_ttft.py)

Setup: a small omni checkpoint (ViT hidden 256 x 4 blocks, MoE text model hidden 256) with real-size
pixel budgets; videos are 720p 30 fps MPEG-4 with a keyframe every 2 s, sampled at 1 frame/s (the
checkpoint's processor config). Every TTFT run uses a video the engine has not seen (cold caches,
after a warm-up request); times are the best of the repetitions, since noise on a shared host only
adds time. The sequential baseline runs the same parts one after the other on the same engine:
VideoDecoder (2 parallel ranges, the engine's codec threads) -> preprocess -> one encoder batch -> LLM
prefill.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _common import base_parser, fresh_thread, new_engine, print_table, write_json
from _loop_lag import LagControl
from _repeat_parts import StepRecorder, settled_stats
from _timeline_tables import print_timeline
from _pipeline_media import HD, bench_decode, make_image, make_video, print_decode_table
from _served_ttft import bench_served
from encoders.image_processing import ImageProcessingConfig
from samples.checkpoints.tiny_towers import init_random_, tiny_vision_config
from encoders.vision.tower import VisionTransformer
from llm_core.engine.sampling import SamplingParams
from mm_pipeline.media.decode.video import VideoDecoder
from mm_pipeline.runtime.embedding_stream import EmbeddingStream, PlaceholderSpan
from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
from mm_pipeline.media.types import DecodedImage, MediaItem, MediaKind
from mm_pipeline.runtime.omni_engine import OmniEngine
from mm_pipeline.encode.preprocess import Preprocessor
from _bench_omni import BENCH_VISION, ENGINE_DEVICE, ONE_TOKEN, ask, build_model, data_part, engine_config, ttft

CPU_ONLY_VARIANTS = ("split", "follow", "one_lane")  # long-video variants of the encoder's CPU thread shares


# ---- media (benchmarks/_pipeline_media.py) and the encoder ----------------------------------
def bench_encoder_batching(n_requests: int, reps: int) -> dict[str, float]:
    """Many requests with one small image each: one packed forward for all vs one forward each."""
    tower = init_random_(VisionTransformer(tiny_vision_config(**BENCH_VISION, out_hidden_size=256)), 0).eval()
    pre = Preprocessor(ImageProcessingConfig(min_pixels=32 * 32, max_pixels=128 * 128))
    rng = torch.Generator().manual_seed(0)
    inputs = [pre.image(DecodedImage(torch.randint(0, 256, (64 + 16 * (i % 3), 64, 3), dtype=torch.uint8,
                                                   generator=rng), "png")) for i in range(n_requests)]

    def run(budget: int) -> float:
        b = EncoderBatcher(tower, None, BatcherConfig(vision_budget=budget, max_wait_s=0.0))
        best = float("inf")
        for r in range(reps + 1):
            for i, v in enumerate(inputs):
                key = f"{r}-{i}"
                b.attach(key, lambda rows, err: None)
                b.submit(EncoderJob(key, "image", vision=v))
            t0 = time.perf_counter()
            b.run_due(force=True)
            if r:  # the first round warms up
                best = min(best, time.perf_counter() - t0)
        return n_requests / best

    per_request = run(budget=1)  # every forward holds exactly one request's unit
    batched = run(budget=1 << 20)
    return {"encoder_units_per_s_batched": batched, "encoder_units_per_s_per_request": per_request,
            "encoder_batching_speedup": batched / per_request}


def sequential_ttft(engine: OmniEngine, video: bytes, question: str) -> float:
    """The non-streaming pipeline on the same parts: decode all -> encode all -> prefill."""
    rt = engine.runtime
    model = rt.model

    async def run() -> float:
        t0 = time.perf_counter()
        item = MediaItem(MediaKind.VIDEO, "mp4", video, "bench")
        decoded = await VideoDecoder(rt.planner.config.video_sampling, pool=rt.pool, num_ranges=2,
                                     threads=rt.planner.config.decoder_threads).decode(item)
        groups = await rt.pool.run(rt.pre.video_groups, decoded.frames,
                                   rt.pre.video_size(decoded.frames.shape[1], decoded.frames.shape[2],
                                                     decoded.num_frames))
        rows = model.vision.encode_items([(g.rows, g.grid) for g in groups])
        from mm_pipeline.prompt.messages import parse_messages
        from mm_pipeline.prompt.layout import MediaSlots

        chat = parse_messages(ask(data_part("video", video), question))
        slots = MediaSlots("video", tuple(int(r.shape[0]) for r in rows), decoded.timestamps[::2])
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
        laid = model.layout.prompt_layout.render(model.tokenizer, messages, [slots])
        assert chat.turns
        spans = [PlaceholderSpan(a, b, f"g{k}") for k, (a, b) in enumerate(laid.unit_spans[0])]
        stream = EmbeddingStream(len(laid.token_ids), spans, model.hidden_size)
        for k, r in enumerate(rows):
            stream.fill(k, r)
        llm = rt.llm
        llm.add_request("sequential", list(laid.token_ids), ONE_TOKEN, embeds=stream)
        while True:
            if any(o.new_token_ids for o in llm.step() if o.request_id == "sequential"):
                return time.perf_counter() - t0

    engine.runtime.loop.stop()  # the baseline drives the LLM itself
    return fresh_thread(asyncio.run, run())  # its team ends with the call: the engines' teams keep spinning


def bench_long_video(model_dir: Path, seconds: int, reps: int) -> dict[str, float]:
    """TTFT of a long video, streamed (encoder worker on, the default) vs streamed with the encoder
    inline on the engine thread vs --no-stream-embeddings vs sequential; distinct videos per run so
    every run is cold. The variants' engines are loaded together and take turns, one request each
    per round, so a burst of load on the shared host hits every variant alike. Then one more cold
    request with the stage timeline on (decode / encode / prefill spans)."""
    question = "What happens in this video?"
    videos = [make_video(seconds, **HD, seed=100 + k) for k in range(7 * reps + 3)]
    warm = make_video(4, **HD, seed=99)
    out: dict[str, float] = {}
    # name -> (config, its slice of the videos: videos[slot * reps:(slot + 1) * reps]; slot 2 is the sequential's)
    variants = {"streamed": ({}, 0), "inline": ({"encoder_worker": False}, 1), "split": ({"encoder_threads": 1}, 3),
                "no_stream": ({"stream_embeddings": False}, 4), "follow": ({"encoder_threads": 0}, 5),
                "one_lane": ({"encoder_lanes": 1}, 6)}
    if ENGINE_DEVICE["device"] != "cpu":  # the CPU thread-share variants mean nothing on a GPU encoder
        variants = {k: v for k, v in variants.items() if k not in CPU_ONLY_VARIANTS}
    engines: dict[str, OmniEngine] = {}
    times: dict[str, list[float]] = {name: [] for name in [*variants, "sequential"]}
    try:
        for name, (kw, _) in variants.items():
            engines[name] = new_engine(model_dir, engine_config(**kw))
            asyncio.run(ttft(engines[name], ask(data_part("video", warm), question)))
        # the baseline takes its turn in every round too: measured after the variants, a burst of
        # load on the shared host inflated it alone (a ratio of 0.09 where a quiet host gives ~0.8)
        sequential = engines["sequential"] = new_engine(model_dir, engine_config())
        sequential_ttft(sequential, warm, question)
        before = engines["streamed"].stats().encoder.get("encoded.video", 0)
        for r in range(reps):
            for name in variants:
                video = videos[variants[name][1] * reps + r]
                times[name].append(asyncio.run(ttft(engines[name], ask(data_part("video", video), question))))
            times["sequential"].append(sequential_ttft(sequential, videos[2 * reps + r], question))
        out["long_video_groups"] = (engines["streamed"].stats().encoder.get("encoded.video", 0) - before) // reps
        out.update(timeline_of_one(engines["streamed"], videos[-1], question))
        no_stream = timeline_of_one(engines["no_stream"], videos[-2], question)
        if "one_lane" in engines:
            out["one_lane_timeline_tail_s"] = timeline_of_one(engines["one_lane"], videos[-3],
                                                              question)["timeline_tail_s"]
        out.update({f"no_stream_{k}": v for k, v in no_stream.items()})
        out["stream_tail_ratio"] = out["timeline_tail_s"] / out["no_stream_timeline_tail_s"]
    finally:
        for engine in engines.values():
            engine.shutdown()
    for name, ts in times.items():
        out[f"long_video_ttft_{name}_s"] = min(ts)  # noise on a shared host only ever adds time
    out["long_video_ttft_ratio"] = out["long_video_ttft_streamed_s"] / out["long_video_ttft_sequential_s"]
    out["encoder_worker_ttft_ratio"] = out["long_video_ttft_streamed_s"] / out["long_video_ttft_inline_s"]
    out["no_stream_ttft_ratio"] = out["long_video_ttft_streamed_s"] / out["long_video_ttft_no_stream_s"]
    if "split" in times:
        out["encoder_split_ttft_ratio"] = out["long_video_ttft_split_s"] / out["long_video_ttft_inline_s"]
        out["encoder_follow_ttft_ratio"] = out["long_video_ttft_follow_s"] / out["long_video_ttft_streamed_s"]
        out["encoder_lanes_ttft_ratio"] = out["long_video_ttft_streamed_s"] / out["long_video_ttft_one_lane_s"]
    return out


def timeline_of_one(engine: OmniEngine, video: bytes, question: str) -> dict[str, float]:
    """One cold long-video request with the stage timeline on: per stage its first start, end of
    its last span and busy time, and the time two stages ran together (seconds from arrival)."""
    messages = ask(data_part("video", video), question)  # the base64 before the clock: ttft's starts after it
    timeline = engine.runtime.record_timeline()
    t0 = time.monotonic()
    first = asyncio.run(ttft(engine, messages))
    summary = timeline.summary(t0, t0 + first)
    return {"timeline_ttft_s": first, "timeline_tail_s": first - summary["decode_last"],
            **{f"timeline_{k}" if k.endswith("_spans") else f"timeline_{k}_s": v for k, v in summary.items()}}


def bench_repeat(model_dir: Path, seconds: int, reps: int) -> dict[str, float]:
    """Cold request; the same media with a new question (encoder cache); the same media and the
    same prompt prefix with another ending (encoder cache + prefix cache). Medians over ``reps``
    distinct videos."""
    engine = new_engine(model_dir, engine_config(enable_prefix_caching=True,
                                                                 prefix_checkpoint_every=64))
    cold, new_q, same, parts, start = [], [], [], [], []
    try:
        asyncio.run(ttft(engine, ask(data_part("video", make_video(4, **HD, seed=98)), "warm up")))
        for k in range(reps):
            part = data_part("video", make_video(seconds, **HD, seed=200 + k))
            cold.append(asyncio.run(ttft(engine, ask(part, "Describe the video in detail."))))
            with StepRecorder(engine) as steps:  # the repeat request's parts (_repeat_parts.py)
                new_q.append(asyncio.run(ttft(engine, [{"role": "user", "content": [
                    {"type": "text", "text": f"Question {k}: how many squares are there?"}, part]}], start)))
            parts.append(steps.parts(start[-1], new_q[-1]))
            same.append(asyncio.run(ttft(engine, ask(part, "Describe the video in detail, but briefly."))))
        stats = settled_stats(engine)
    finally:
        engine.shutdown()
    c, n, p = min(cold), min(new_q), min(same)
    return {"cold_media_ttft_s": c, "repeat_media_ttft_s": n, "same_prefix_ttft_s": p,
            "repeat_media_ttft_ratio": n / c, "same_prefix_ttft_ratio": p / c,
            "prefix_hit_tokens": sum(stats.llm.prefix_cache_hit_tokens.values()), **parts[new_q.index(n)],
            # the intra-op threads the engine thread and the encoder ran at (--llm-threads / --encoder-threads auto)
            **{f"repeat_{k}_threads": float(v) for k, v in stats.intra_op_threads.items()}}


def bench_loop_lag(model_dir: Path, n: int) -> dict[str, float]:
    """Max event-loop lag while ``n`` media requests (images and short videos) run concurrently."""
    engine = new_engine(model_dir, engine_config())
    media = [data_part("image", make_image(i, (160 + 16 * (i % 4), 120))) if i % 2 else
             data_part("video", make_video(seconds=4 + i % 3, fps=10, size=(160, 120))) for i in range(n)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run() -> list[float]:
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                control.tick()  # the stall sampler's clock (_loop_lag.py)
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t0 - 0.005)

        async def one(part) -> None:
            async for _ in engine.generate(ask(part, "Describe."), params):
                pass

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(one(p) for p in media))
        done.set()
        await tick
        return lags

    try:
        with LagControl() as control:
            lags = asyncio.run(run())
    finally:
        engine.shutdown()
    return {"max_loop_lag_ms": max(lags) * 1000, "p99_loop_lag_ms": float(np.percentile(lags, 99)) * 1000,
            "loop_lag_requests": n, **{f"loop_lag_{k}": v for k, v in control.result().items()}}


def run_once(quick: bool, only: str | None = None) -> dict[str, float]:
    return fresh_thread(_run_once, quick, only)


def _run_once(quick: bool, only: str | None) -> dict[str, float]:  # every part, or ``only`` (one of ONLY)
    if only == "decode":
        return bench_decode(quick)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = fresh_thread(build_model, Path(tmp))
        if only in (None, "long-video"):
            results.update(fresh_thread(bench_long_video, model_dir, seconds=16 if quick else 48, reps=2 if quick else 3))
        if only in (None, "repeat"):
            results.update(fresh_thread(bench_repeat, model_dir, seconds=12 if quick else 32, reps=2 if quick else 3))
        if only in (None, "loop-lag"):
            results.update(fresh_thread(bench_loop_lag, model_dir, n=32))
    if only is None:
        results.update(bench_decode(quick))
        results.update(fresh_thread(bench_encoder_batching, n_requests=16 if quick else 32, reps=2 if quick else 3))
    return results


# --<part>-only flags: run one part alone (its keys only)
ONLY = {"decode": "only the decode tables (1/2/4 workers, threads vs processes, H.264 non-reference frames)",
        "repeat": "only the cached-media TTFTs (cold, new question, same prefix) and their ratios",
        "long-video": "only the cold long-video TTFTs (streamed variants, no-stream, sequential), timelines",
        "loop-lag": "only the event-loop lag (32 concurrent media requests; --repeat N: max = the worst run)"}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run everything N times; report the median of each key and its spread (min, max)")
    parser.add_argument("--served", action="store_true",
                        help="only the served check: a fresh 720p video through `mmserve serve` (demo model), "
                             "streaming on vs --no-stream-embeddings, vs plain PyAV (60 s clip; --quick: 20 s); "
                             "then the same engine in-process with its stage timeline (the ceiling on "
                             "streaming's gain)")
    parser.add_argument("--h264", action="store_true", help="with --served: H.264 clips with B-frames, not MPEG-4")
    for part, text in ONLY.items():
        parser.add_argument(f"--{part}-only", action="store_true", help=text)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the engines run (cuda: bf16, the encoder on its own stream; the goals are "
                             "the 2-core CPU host's)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA GPU")
        ENGINE_DEVICE.update(device="cuda", dtype="bfloat16")
    chosen = [part for part in ONLY if getattr(args, f"{part.replace('-', '_')}_only")]
    if len(chosen) > 1:
        parser.error("give at most one --<part>-only flag")
    only = chosen[0] if chosen else None
    if args.served:
        results = bench_served(seconds=20 if args.quick else 60, reps=args.repeat, h264=args.h264)
        print_table(f"served (medians of {args.repeat}; pair k: streamed TTFT / the PyAV decode timed just before it)",
                    ["metric", "value"], sorted(results.items()))
        write_json(args.json, results)
        return
    runs = []
    for r in range(args.repeat):
        runs.append(run_once(args.quick, only))
        if args.repeat > 1:
            print(f"run {r + 1}/{args.repeat} done", flush=True)
    results = {k: float(np.median([run[k] for run in runs])) for k in runs[0]}
    rows = [(k, results[k], min(run[k] for run in runs), max(run[k] for run in runs)) for k in sorted(results)]
    print_table(f"pipeline (median of {args.repeat} run{'s' * (args.repeat > 1)})", ["metric", "median", "min", "max"],
                [r for r in rows if "timeline_" not in r[0]])
    if only in (None, "decode"):
        print_decode_table(results)
    if only in (None, "long-video"):
        print_timeline(results)
    spread = {f"{k}_min": lo for k, _, lo, _ in rows} | {f"{k}_max": hi for k, _, _, hi in rows}
    write_json(args.json, {**results, **(spread if args.repeat > 1 else {}), "repeat": args.repeat})


if __name__ == "__main__":
    main()
