"""Decoding while the bytes arrive (issue 16 item 4): time to first token of a fresh 720p video
fetched over http from a throttled loopback host, through ``mmserve serve`` (demo model), with
--decode-while-receiving (the default) and --no-decode-while-receiving, side by side in one run.

    .venv/bin/python benchmarks/arriving_media.py --quick --json /tmp/arriving.json
    .venv/bin/python benchmarks/arriving_media.py --repeat 3 --rate-mb-s 30 --layout index fragments

Keys (prefixed by the layout):
  ttft_early_s / ttft_after_s   first streamed token after the request was sent (medians)
  ttft_ratio                    early / after                                  (< 1: the feature helps)
  arrival_s                     seconds the host takes to send the body at --rate-mb-s
  pyav_all_frames_s             plain PyAV decoding every frame of the same file (the floor)
  early_frames_used / early_frames_decoded_after
                                sampled frames the early decode had kept / production decoded after
                                arrival (from /metrics of the early server, warm-up clip included)

The video: ``make_camera_video`` (720p, 30 fps, keyframe every 2 s, MPEG-4 part 2 at ~6 Mbit/s),
remuxed without re-encoding into the layout asked for: ``index`` (moov first), ``matroska``,
``fragments`` (fragmented MP4, empty moov: no frame count up front, so it is decoded after arrival
either way and its ratio shows what the feature costs when it cannot help). A new
server per variant and repetition, so every timed request is cold (after a short warm-up clip).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import io
from pathlib import Path

import av
import httpx
import numpy as np

from _common import base_parser, first_token_s, print_table, write_json
from _pipeline_media import HD, pyav_decode_all
from mm_pipeline.server.launch.server_process import ServerProcess
from samples.synthetic.throttled_http import ThrottledMediaServer, remux_layout

DEMO = Path(__file__).resolve().parents[1] / "samples" / "demo-model"


def make_camera_video(seconds: int, seed: int, mbit_s: float = 6.0) -> bytes:
    """720p 30 fps, a keyframe every 2 s, at about ``mbit_s`` (what a phone sends; the pipeline
    benchmark's clips compress to ~1 Mbit/s and arrive too fast to overlap anything): a static
    background, per-frame grain from a few noise planes, a moving square."""
    w, h = HD["size"]
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
    grain = [rng.integers(0, 16, (h, w, 3), dtype=np.uint8) for _ in range(5)]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=HD["fps"])
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.bit_rate = int(mbit_s * 1e6)
        stream.codec_context.options = {"g": str(HD["gop"]), "bf": "0"}
        for k in range(seconds * HD["fps"]):
            img = base + grain[k % len(grain)] + np.uint8((k * 3) % 150)
            x = (7 * k) % (w - 32)
            img[40:72, x:x + 32] = 255
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = k
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def first_token(base_url: str, model: str, url: str) -> float:
    return first_token_s(base_url, {
        "model": model, "max_tokens": 1, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                  {"type": "text", "text": "What happens in this video?"}]}]})


def early_counts(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("mmserve_media_early"):
            for s in family.samples:
                key = s.name.removeprefix("mmserve_media_").removesuffix("_total")
                out[key] = out.get(key, 0.0) + s.value
    return out


def run(seconds: int, reps: int, rate: float, layout: str) -> dict[str, float]:
    video = remux_layout(make_camera_video(seconds, seed=400), layout)
    warm = remux_layout(make_camera_video(2, seed=401), layout)
    times: dict[str, list[float]] = {"early": [], "after": [], "pyav": []}
    counts: dict[str, float] = {}
    flags = ["--model", str(DEMO), "--allow-http", "--allowed-domains", "127.0.0.1", "--allow-private-hosts",
             "--fetch-timeout-s", "120"]
    with ThrottledMediaServer({"/clip": video, "/warm": warm}, rate_bytes_s=rate) as host:
        for _ in range(reps):
            for name, extra in (("early", []), ("after", ["--no-decode-while-receiving"])):
                with ServerProcess([*flags, *extra]) as server:
                    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    first_token(server.base_url, model, host.url("/warm"))  # first-request costs
                    times[name].append(first_token(server.base_url, model, host.url("/clip")))
                    if name == "early":
                        counts = early_counts(server.base_url)
            times["pyav"].append(pyav_decode_all(video))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"ttft_early_s": med["early"], "ttft_after_s": med["after"], "ttft_ratio": med["early"] / med["after"],
            "ttft_early_spread_s": max(times["early"]) - min(times["early"]),
            "ttft_after_spread_s": max(times["after"]) - min(times["after"]),
            "arrival_s": len(video) / rate, "video_mb": len(video) / 1e6, "pyav_all_frames_s": med["pyav"],
            "early_frames_used": counts.get("early_frames_used", 0.0),
            "early_frames_decoded_after": counts.get("early_frames_decoded_after", 0.0),
            "early_decode_bytes_outstanding_mb": counts.get("early_decode_bytes_outstanding", 0.0) / 1e6}


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=None, metavar="N", help="repetitions (medians; default 1 quick, 3 full)")
    parser.add_argument("--rate-mb-s", type=float, default=30.0, help="the media host's send rate in MB/s")
    parser.add_argument("--layout", choices=["fragments", "index", "matroska"], nargs="+",
                        default=["index", "fragments"], help="container layouts, each its own rows")
    parser.add_argument("--seconds", type=int, default=None, help="video length (default 20 quick, 60 full)")
    args = parser.parse_args()
    reps = args.repeat or (1 if args.quick else 3)
    seconds = args.seconds or (20 if args.quick else 60)
    results: dict[str, float] = {}
    for layout in args.layout:
        one = run(seconds, reps, args.rate_mb_s * 1e6, layout)
        print_table(f"decode while receiving: {seconds} s 720p, {layout}, at {args.rate_mb_s:g} MB/s "
                    f"(median of {reps})", ["metric", "value"], sorted(one.items()))
        results.update({f"{layout}_{k}": v for k, v in one.items()})
    write_json(args.json, {**results, "seconds": seconds, "repeat": reps, "rate_mb_s": args.rate_mb_s})


if __name__ == "__main__":
    main()
