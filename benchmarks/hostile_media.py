"""What each hostile input of issue 22 costs a running server: HTTP status, seconds to the answer and
the growth of the server process's peak RSS, then whether admission, the worker pools and the
decoded-bytes budget went back to idle.

The server runs in this process (``ServerThread``) so its RSS is ours; the peak is reset before each
request (``samples.synthetic.hostile_media.measured``). Inputs are generated in memory
(``samples/synthetic/hostile_media.py``). Rows: 1 (8192² / 4096² MP4), 4 (50 MB of text), 6 (GIF of
300 one-pixel frames on a 4096² canvas), 7 (8 distinct 8192² PNGs; an hour of silent FLAC), 8 (an
upload over the media cap, n=8), 9 (a FIFO in an allowed directory), and an ``input_audio`` part
of 100 MB of base64 (``--quick``: 24 MB) over the media cap. Two rows fetch from a throttled
loopback host (30 MB/s), as http(s) media is decoded while it arrives: the 4096² MP4, and an MP4
with 1 MiB of 8-byte boxes after its ``ftyp`` (the layout is looked for on the event loop as the
bytes come). Beside each row: the server's largest event-loop lag while it ran (the ``/metrics``
max gauge's monitor, reset before the request; goal <= 50 ms).

    python benchmarks/hostile_media.py [--model samples/demo-model] [--quick] [--json out.json]
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import base64
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
from _common import base_parser, print_table, write_json

from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.runtime.omni_engine import OmniEngine
from mm_pipeline.server import ServerSettings, ServerThread, create_app
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
from samples.synthetic.hostile_media import (huge_png, huge_video, measured, pixel_frames_gif, png_variant, silent_flac,
                                             tiny_boxes_mp4)
from samples.synthetic.throttled_http import ThrottledMediaServer


def _url(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", help="omni checkpoint directory (default: a tiny random one)")
    p.add_argument("--max-media-mb", type=float, default=16.0, help="MediaLimits.max_bytes of the server")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    model = args.model or build_tiny_omni_checkpoint(work / "tiny-omni", seed=0)
    local = work / "local"
    local.mkdir()
    cap = int(args.max_media_mb * (1 << 20))
    engine = OmniEngine.from_pretrained(model, OmniEngineConfig.from_kwargs(
        num_full_tokens=8192, num_swa_tokens=2048, max_num_seqs=4, allowed_local_dirs=(str(local),),
        limits=MediaLimits(max_bytes=cap), allow_http=True, allowed_domains=("127.0.0.1",),
        allow_private_hosts=True))
    clip = huge_video(4096)
    host = ThrottledMediaServer({"/clip.mp4": clip, "/boxes.mp4": tiny_boxes_mp4(clip)}, rate_bytes_s=30e6)
    host.__enter__()
    app = create_app(engine, ServerSettings(files_dir=str(work / "files")))
    server = ServerThread(app).start()
    name = engine.model_name

    def chat(content, **body):
        # The client runs in this process too, so what it does holding the GIL the server's event
        # loop waits out as lag: the body is encoded here, before the timed call (json.dumps of a
        # 100 MB string holds it for ~0.1 s), and sent in pieces of 1 MB (given whole, httpcore
        # slices what is left to send after each send(): a copy of up to 100 MB each time).
        raw = json.dumps({"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": content}],
                          **body}).encode()
        headers = {"content-type": "application/json", "content-length": str(len(raw))}
        return lambda: httpx.post(server.base_url + "/v1/chat/completions", timeout=300, headers=headers,
                                  content=(raw[i:i + (1 << 20)] for i in range(0, len(raw), 1 << 20)))

    def video(raw: bytes, mime: str = "video/mp4") -> dict:
        return {"type": "video_url", "video_url": {"url": _url(raw, mime)}}

    png = huge_png()
    flac = silent_flac()
    upload = httpx.post(server.base_url + "/v1/files", files={"file": ("big.png", b"\x89PNG\r\n\x1a\n" + os.urandom(cap))},
                        data={"purpose": "vision"}, timeout=300).json()["id"]
    os.mkfifo(local / "pipe.png")
    text = "ab " * ((5 if args.quick else 50) * (1 << 20) // 3)
    audio_b64 = "AAAA" * ((24 if args.quick else 100) * (1 << 20) // 4)
    cases = [
        ("1", "MP4 8 frames 4096²", chat([video(huge_video(4096))])),
        ("4", f"{len(text) >> 20} MB of text", chat(text)),
        ("6", "GIF 300 px-frames, 4096² canvas", chat([video(pixel_frames_gif(), "image/gif")])),
        ("7", "8 distinct 8192² PNGs", chat([{"type": "image_url", "image_url": {"url": _url(png_variant(png, k),
                                                                                              "image/png")}}
                                            for k in range(8)])),
        ("7", "1 h of silent FLAC", chat([{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(flac).decode(), "format": "flac"}}])),
        ("8", f"upload over the {args.max_media_mb:g} MB cap, n=8", chat([{"type": "file", "file": {"file_id": upload}}],
                                                                        n=8)),
        ("9", "FIFO in an allowed directory", chat([{"type": "image_url", "image_url": {
            "url": (local / "pipe.png").as_uri()}}])),
        ("—", f"input_audio of {len(audio_b64) >> 20} MB base64 (over the cap)", chat([{
            "type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}}])),
        ("—", "http: MP4 8 frames 4096²", chat([{"type": "video_url", "video_url": {"url": host.url("/clip.mp4")}}])),
        ("—", "http: MP4, 1 MiB of 8-byte boxes first", chat([{"type": "video_url", "video_url": {
            "url": host.url("/boxes.mp4")}}])),
    ]
    if not args.quick:
        cases.insert(0, ("1", "MP4 8 frames 8192²", chat([video(huge_video(8192))])))
    rows, results = [], {}
    try:
        for row, what, send in cases:
            lag = app.state.metrics.lag_monitor
            lag.max_lag_s = 0.0
            response, seconds, grown = measured(send)
            lag_ms = 1e3 * lag.max_lag_s
            idle = _idle(engine)
            rows.append((row, what, response.status_code, seconds, grown, lag_ms, idle))
            key = f"row{row if row != '—' else 'x'}_{len(rows)}"
            results.update({f"{key}_status": response.status_code, f"{key}_seconds": seconds,
                            f"{key}_peak_rss_growth_mb": grown, f"{key}_loop_lag_max_ms": lag_ms,
                            f"{key}_idle_after": idle})
    finally:
        server.stop()
        engine.shutdown()
        host.__exit__(None, None, None)
    print_table(f"hostile inputs against {name} (peak RSS growth of the server process)",
                ["row", "input", "status", "seconds", "peak RSS +MB", "loop lag ms", "idle after"], rows)
    write_json(args.json, results)


def _idle(engine: OmniEngine, timeout_s: float = 10.0) -> bool:
    runtime = engine.runtime
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (engine.requests_in_flight or runtime.pool.admitted or runtime.text_pool.admitted
                or runtime.planner.producer.budget.in_use):
            return True
        time.sleep(0.02)
    return False


if __name__ == "__main__":
    main()
