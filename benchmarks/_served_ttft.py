"""The served check of benchmarks/pipeline.py (``--served``): a fresh 720p video through
``mmserve serve`` with the demo model, against plain PyAV decoding every frame of the same file.

One plain-PyAV decode is timed right before every served request, so each request has its own
baseline measured under the same load (a single PyAV figure per run moved the ratio from 1.31× to
1.94× between two quiet-box sessions while the served TTFT fell). Reported: the ratio of the
medians and every pair's own ratio, and beside each wall time the CPU seconds it cost -- the
server process's (``/proc/<pid>/stat``: every thread, from just before the request is sent to its
first token) and PyAV's (this process's ``process_time``). On a 2-core host the TTFT cannot go
below the request's CPU / 2, so the CPU columns say whether a change did less work or only got
luckier with the load.

    served_ttft_{streamed,no_stream}_s       median TTFT, streaming on / --no-stream-embeddings
    served_cpu_{streamed,no_stream}_s        median server-process CPU seconds of that request
    served_pyav_all_frames_s / _cpu_s        median plain-PyAV decode of every frame (codec threads on)
    served_ttft_over_pyav                    median streamed TTFT / median PyAV wall          [<= 1.5]
    served_pair_ratio_median                 median of the per-pair ratios (streamed / its own PyAV)
    served_cpu_over_pyav                     median streamed server CPU / median PyAV CPU
    served_stream_gain                       median no-stream TTFT / median streamed TTFT     [> 1]
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from _common import first_token_s
from _pipeline_media import HD, make_h264, make_video, process_cpu_s, pyav_decode_all_cpu

DEMO = Path(__file__).resolve().parents[1] / "samples" / "demo-model"
VARIANTS = (("streamed", ()), ("no_stream", ("--no-stream-embeddings",)))


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


def served_request(server, body: dict) -> tuple[float, float]:
    """(TTFT s, server CPU s from just before sending to the first token) of ``body``."""
    cpu0 = process_cpu_s(server.proc.pid)
    ttft = first_token_s(server.base_url, body)
    return ttft, process_cpu_s(server.proc.pid) - cpu0


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
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _ in VARIANTS}
    for r in range(reps):
        for name, flags in VARIANTS:
            with make(["--model", str(DEMO), *flags]) as server:
                warm_up(server, body, warm)
                pyav_wall, pyav_cpu = pyav_decode_all_cpu(video)  # this pair's baseline, right before
                ttft, cpu = served_request(server, body)
            runs[name].append((ttft, cpu, pyav_wall, pyav_cpu))
            print(f"{label}round {r + 1}/{reps} {name}: TTFT {ttft:.3f} s (server CPU {cpu:.2f} s), "
                  f"PyAV {pyav_wall:.3f} s (CPU {pyav_cpu:.2f} s), ratio {ttft / pyav_wall:.2f}", flush=True)
    return summarize(runs)


def summarize(runs: dict[str, list[tuple[float, float, float, float]]]) -> dict[str, float]:
    """The keys in the module doc from per-variant (TTFT, server CPU, PyAV wall, PyAV CPU) rows."""
    med = lambda rows, i: float(np.median([row[i] for row in rows]))  # noqa: E731
    pyav = [row for rows in runs.values() for row in rows]  # every pair's baseline
    s, n = runs["streamed"], runs["no_stream"]
    out = {"served_ttft_streamed_s": med(s, 0), "served_ttft_no_stream_s": med(n, 0),
           "served_cpu_streamed_s": med(s, 1), "served_cpu_no_stream_s": med(n, 1),
           "served_pyav_all_frames_s": med(pyav, 2), "served_pyav_all_frames_cpu_s": med(pyav, 3)}
    out["served_ttft_over_pyav"] = out["served_ttft_streamed_s"] / out["served_pyav_all_frames_s"]
    out["served_pair_ratio_median"] = float(np.median([t / p for t, _, p, _ in s]))
    out["served_cpu_over_pyav"] = out["served_cpu_streamed_s"] / out["served_pyav_all_frames_cpu_s"]
    out["served_stream_gain"] = out["served_ttft_no_stream_s"] / out["served_ttft_streamed_s"]
    for k, (t, _, p, _) in enumerate(s):
        out[f"served_pair_{k + 1}_ratio"] = t / p
    for k, (t, _, p, _) in enumerate(n):
        out[f"served_pair_{k + 1}_no_stream_ratio"] = t / p
    return out
