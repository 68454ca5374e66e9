"""The served check of benchmarks/pipeline.py (``--served``): a fresh 720p video through
``mmserve serve`` with the demo model, against plain PyAV decoding every frame of the same file.

One plain-PyAV decode is timed right before every served request, so each request has its own
baseline measured under the same load (a single PyAV figure per run moved the ratio from 1.31× to
1.94× between two quiet-box sessions while the served TTFT fell). Reported: the ratio of the
medians and every pair's own ratio, and beside each wall time the CPU seconds it cost -- the
server process's (``/proc/<pid>/stat``: every thread, from just before the request is sent to its
first token) and PyAV's (this process's ``process_time``). On a 2-core host the TTFT cannot go
below the request's CPU / 2, so the CPU columns say whether a change did less work or only got
luckier with the load. The same window's busy time of the whole host (``/proc/stat``: the server,
this client sending the body and reading the stream, anything else) gives the cores that sat idle;
streaming can only move the prefill's work into idle cores (its work is the same: the CPU columns),
so ``served_stream_gain_bound`` -- the no-stream TTFT over the streamed request's CPU floor -- is the
most any order of that work could gain on this host.

A tighter ceiling comes from the engine's stage timeline, which the server's process does not expose:
the same default-flag demo engine in this process, a cold clip of the same length per variant
(``engine_waits``). ``--no-stream-embeddings`` decodes and encodes chunk by chunk as streaming does;
only its prefill waits for the last embedding, so streaming can shorten nothing but the wait from the
last encoder forward to the first token:

    best streamed TTFT = no-stream TTFT - no-stream wait + streamed wait   (decode and encode no later)

    served_ttft_{streamed,no_stream}_s       median TTFT, streaming on / --no-stream-embeddings
    served_cpu_{streamed,no_stream}_s        median server-process CPU seconds of that request
    served_pyav_all_frames_s / _cpu_s        median plain-PyAV decode of every frame (codec threads on)
    served_ttft_over_pyav                    median streamed TTFT / median PyAV wall          [<= 1.5]
    served_pair_ratio_median                 median of the per-pair ratios (streamed / its own PyAV)
    served_cpu_over_pyav                     median streamed server CPU / median PyAV CPU
    served_stream_gain                       median no-stream TTFT / median streamed TTFT     [> 1]
    served_idle_{streamed,no_stream}_s       median idle core-seconds of the host, send to first token
                                             (cores x TTFT - the host's busy CPU seconds)
    served_ttft_floor_s                      median streamed server CPU / the host's cores: the TTFT
                                             that work cannot beat here, however it is scheduled
    served_stream_gain_bound                 median no-stream TTFT / served_ttft_floor_s
    served_engine_ttft_{streamed,no_stream}_s   in-process demo engine: median TTFT
    served_engine_wait_{streamed,no_stream}_s   its median wait from the last encoder forward to the
                                                first token
    served_stream_gain_ceiling               no-stream engine TTFT / the best streamed TTFT above
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from _bench_omni import ask, data_part, ttft
from _common import first_token_s, new_engine
from _pipeline_media import HD, make_h264, make_video, process_cpu_s, pyav_decode_all_cpu
from mm_pipeline import cli
from mm_pipeline.runtime.cpu_threads.host_cpu import USER_HZ, busy_ticks

DEMO = Path(__file__).resolve().parents[1] / "samples" / "demo-model"
VARIANTS = (("streamed", ()), ("no_stream", ("--no-stream-embeddings",)))
CPUS = frozenset(os.sched_getaffinity(0))  # the server inherits this process's CPU set


def host_busy_s() -> float:
    """Busy CPU seconds of this process's CPUs so far, every process's (/proc/stat, tick resolution)."""
    with open("/proc/stat") as f:
        return busy_ticks(f.read(), CPUS) / USER_HZ


def _video_body(video: bytes, text: str) -> dict:
    part = {"type": "video_url", "video_url": {"url": "data:;base64," + base64.b64encode(video).decode()}}
    return {"model": "", "max_tokens": 1, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}]}


def warm_up(server, body: dict, warm: dict) -> None:
    """Name the model in both bodies and send the warm-up request: first-request costs (lazy
    imports, allocator) are not TTFT."""
    name = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body["model"] = warm["model"] = name
    first_token_s(server.base_url, warm)
    time.sleep(0.2)  # the warm-up's tail (its last step, logs) ends off the clock


def served_request(server, body: dict) -> tuple[float, float, float]:
    """(TTFT s, server CPU s, idle core-seconds of the host) of ``body``, from just before sending
    to the first token."""
    cpu0, busy0 = process_cpu_s(server.proc.pid), host_busy_s()
    ttft = first_token_s(server.base_url, body)
    cpu, busy = process_cpu_s(server.proc.pid) - cpu0, host_busy_s() - busy0
    return ttft, cpu, max(0.0, len(CPUS) * ttft - busy)


def bench_served(seconds: int, reps: int, server_factory: Callable[[list[str]], object] | None = None,
                 label: str = "", h264: bool = False) -> dict[str, float]:
    """``reps`` rounds; per round and variant a new server (every request cold: no disk cache by
    default), warmed up, then PyAV and the served request back to back. ``server_factory(args)`` makes the
    (context-managed) server; default ``ServerProcess`` of this checkout. ``label`` prefixes the
    progress lines. ``h264``: the clips are H.264 with B-frames (``make_h264``), not MPEG-4 part 2."""
    from mm_pipeline.server.launch.server_process import ServerProcess

    make = server_factory or ServerProcess
    clip = (lambda s, seed: make_h264(s, seed=seed)) if h264 else (lambda s, seed: make_video(s, **HD, seed=seed))
    video = clip(seconds, 300)
    body = _video_body(video, "What happens in this video?")
    warm_clip = clip(2, 301)
    warm = _video_body(warm_clip, "Warm up.")
    pyav_decode_all_cpu(warm_clip)  # this process's first decode pays PyAV's own set-up
    runs: dict[str, list[tuple[float, float, float, float, float]]] = {name: [] for name, _ in VARIANTS}
    for r in range(reps):
        for name, flags in VARIANTS:
            with make(["--model", str(DEMO), *flags]) as server:
                warm_up(server, body, warm)
                pyav_wall, pyav_cpu = pyav_decode_all_cpu(video)  # this pair's baseline, right before
                ttft, cpu, idle = served_request(server, body)
            runs[name].append((ttft, cpu, pyav_wall, pyav_cpu, idle))
            print(f"{label}round {r + 1}/{reps} {name}: TTFT {ttft:.3f} s (server CPU {cpu:.2f} s, host idle "
                  f"{idle:.2f} core-s), PyAV {pyav_wall:.3f} s (CPU {pyav_cpu:.2f} s), ratio {ttft / pyav_wall:.2f}",
                  flush=True)
    out = summarize(runs)
    if server_factory is None:  # the engine of this checkout (a factory may serve another one)
        out |= engine_waits(clip, seconds, reps)
    return out


def engine_waits(clip: Callable[[int, int], bytes], seconds: int, reps: int) -> dict[str, float]:
    """The ``served_engine_*`` keys and ``served_stream_gain_ceiling`` (module doc): per variant the
    demo engine the served check's server runs (its flags through `mmserve serve`'s parser: on CUDA
    where the machine has it), in this process, warmed up, then ``reps`` cold clips of ``seconds``
    (``clip(seconds, seed)``) with the stage timeline on."""
    out: dict[str, float] = {}
    for name, flags in VARIANTS:
        config = cli.engine_config(cli.build_parser().parse_args(["serve", "--model", str(DEMO), *flags]))
        engine = new_engine(DEMO, config)
        firsts, waits = [], []
        try:
            asyncio.run(ttft(engine, ask(data_part("video", clip(2, 301)), "Warm up.")))
            for r in range(reps):
                # the base64 before the timeline's clock starts: ttft's own clock starts after it
                messages = ask(data_part("video", clip(seconds, 500 + r)), "What happens in this video?")
                time.sleep(0.2)  # the warm-up's or the last request's tail, off the clock
                timeline = engine.runtime.record_timeline()
                t0 = time.monotonic()
                first = asyncio.run(ttft(engine, messages))
                summary = timeline.summary(t0, t0 + first)
                firsts.append(first)
                waits.append(first - summary["encode_last"])
                print(f"engine round {r + 1}/{reps} {name}: TTFT {first:.3f} s, {waits[-1] * 1e3:.0f} ms after the "
                      f"last encoder forward ({summary['prefill_spans']:.0f} steps, {summary['prefill_busy'] * 1e3:.0f} "
                      f"ms busy before the first token)", flush=True)
        finally:
            engine.shutdown()
        out[f"served_engine_ttft_{name}_s"] = float(np.median(firsts))
        out[f"served_engine_wait_{name}_s"] = float(np.median(waits))
    best = out["served_engine_ttft_no_stream_s"] - out["served_engine_wait_no_stream_s"] + out["served_engine_wait_streamed_s"]
    out["served_stream_gain_ceiling"] = out["served_engine_ttft_no_stream_s"] / best
    return out


def summarize(runs: dict[str, list[tuple[float, float, float, float, float]]], cores: int = len(CPUS)
              ) -> dict[str, float]:
    """The keys in the module doc from per-variant (TTFT, server CPU, PyAV wall, PyAV CPU, host idle
    core-seconds) rows; ``cores``: the host's CPUs the server may use."""
    med = lambda rows, i: float(np.median([row[i] for row in rows]))  # noqa: E731
    pyav = [row for rows in runs.values() for row in rows]  # every pair's baseline
    s, n = runs["streamed"], runs["no_stream"]
    out = {"served_ttft_streamed_s": med(s, 0), "served_ttft_no_stream_s": med(n, 0),
           "served_cpu_streamed_s": med(s, 1), "served_cpu_no_stream_s": med(n, 1),
           "served_pyav_all_frames_s": med(pyav, 2), "served_pyav_all_frames_cpu_s": med(pyav, 3)}
    out["served_ttft_over_pyav"] = out["served_ttft_streamed_s"] / out["served_pyav_all_frames_s"]
    out["served_pair_ratio_median"] = float(np.median([t / p for t, _, p, *_ in s]))
    out["served_cpu_over_pyav"] = out["served_cpu_streamed_s"] / out["served_pyav_all_frames_cpu_s"]
    out["served_stream_gain"] = out["served_ttft_no_stream_s"] / out["served_ttft_streamed_s"]
    out["served_idle_streamed_s"], out["served_idle_no_stream_s"] = med(s, 4), med(n, 4)
    out["served_ttft_floor_s"] = out["served_cpu_streamed_s"] / cores
    out["served_stream_gain_bound"] = out["served_ttft_no_stream_s"] / out["served_ttft_floor_s"]
    for k, (t, _, p, _, _) in enumerate(s):
        out[f"served_pair_{k + 1}_ratio"] = t / p
    for k, (t, _, p, _, _) in enumerate(n):
        out[f"served_pair_{k + 1}_no_stream_ratio"] = t / p
    return out
