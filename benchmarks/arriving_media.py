"""Decoding while the bytes arrive (issue 16 item 4): time to first token of a fresh 720p video
or audio file fetched over http from a throttled loopback host, through ``mmserve serve`` (demo
model), with --decode-while-receiving (the default) and --no-decode-while-receiving, side by side
in one run.

    .venv/bin/python benchmarks/arriving_media.py --quick --json /tmp/arriving.json
    .venv/bin/python benchmarks/arriving_media.py --repeat 3 --rate-mb-s 30 --layout index fragments-sidx
    .venv/bin/python benchmarks/arriving_media.py --repeat 3 --layout --audio wav opus --audio-rate-kb-s 256
    .venv/bin/python benchmarks/arriving_media.py --repeat 3 --sound --layout index matroska --audio
    .venv/bin/python benchmarks/arriving_media.py --repeat 3 --h264 --layout index --audio --rate-mb-s 4

Keys (prefixed by the layout):
  ttft_early_s / ttft_after_s   first streamed token after the request was sent (medians)
  ttft_ratio                    early / after                                  (< 1: the feature helps)
  arrival_s                     seconds the host takes to send the body at --rate-mb-s
  pyav_all_frames_s             plain PyAV decoding every frame of the same file (the floor)
  early_frames_used / early_frames_decoded_after
                                sampled frames the early decode had kept / production decoded after
                                arrival (from /metrics of the early server, warm-up clip included)
  loop_lag_max_early_ms / loop_lag_max_after_ms
                                the servers' largest event-loop lag (/metrics' max gauge: start-up,
                                warm-up and timed request), worst of the repetitions
  early_frames_decoded / early_packets_skipped
                                frames the early decoder decoded / packets it dropped undecoded (the
                                tails of keyframe spans after their last sampled frame; same server)
With --h264 the video is ``make_h264`` (x264 veryfast, B-frames, a camera pan; keys ``<layout>_h264_``):
what the early decoder's dropping of unkept non-reference frames acts on.
With --sound the videos carry a sound track (AAC, 48 kHz stereo, 128 kbit/s: what a phone
records; the demo model hears videos) and the keys are prefixed ``<layout>_sound_``; besides the
video keys, pyav_sound_decode_s (plain PyAV decoding and resampling the sound track to 16 kHz)
and early_sound_used (videos whose sound samples came from the early decode).
Audio rows (``audio_<format>_``): the same keys, pyav_decode_s (plain PyAV decoding and resampling
the file to 16 kHz: what decoding early can hide) and early_audio_used (items whose samples came
from the early decode).

The video: ``make_camera_video`` (720p, 30 fps, keyframe every 2 s, MPEG-4 part 2 at ~6 Mbit/s),
remuxed without re-encoding into the layout asked for: ``index`` (moov first), ``matroska``,
``fragments`` (fragmented MP4, empty moov: no frame count up front, so it is decoded after arrival
either way and its ratio shows what the feature costs when it cannot help), ``fragments-sidx``
(FFmpeg's global_sidx: the duration up front), ``index-at-end`` (moov after mdat, FFmpeg's
default MP4: the early server fetches the moov by a range request first; the host answers
ranges). The audio: a mono 16 kHz voice-band noise signal of --audio-seconds (the demo model's
2,048-token context holds about 80 s), as WAV, MP3, Ogg/Opus, FLAC or M4A (AAC, moov last), sent
at --audio-rate-kb-s. A new server per variant and repetition, so every timed request is cold
(after a short warm-up item).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import io
import time
from pathlib import Path
from typing import Callable

import av
import httpx
import numpy as np

from _common import base_parser, first_token_s, print_table, write_json
from _pipeline_media import HD, make_h264, pyav_decode_all
from mm_pipeline.server.launch.server_process import ServerProcess
from samples.synthetic.throttled_http import ThrottledMediaServer, remux_layout

DEMO = Path(__file__).resolve().parents[1] / "samples" / "demo-model"


def make_camera_video(seconds: int, seed: int, mbit_s: float = 6.0, sound: bool = False) -> bytes:
    """720p 30 fps, a keyframe every 2 s, at about ``mbit_s`` (what a phone sends; the pipeline
    benchmark's clips compress to ~1 Mbit/s and arrive too fast to overlap anything): a static
    background, per-frame grain from a few noise planes, a moving square; ``sound``: with an AAC
    track (48 kHz stereo) of tone bursts, muxed frame by frame so the streams interleave by time."""
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
        track = _SoundTrack(out, seconds, seed) if sound else None
        for k in range(seconds * HD["fps"]):
            img = base + grain[k % len(grain)] + np.uint8((k * 3) % 150)
            x = (7 * k) % (w - 32)
            img[40:72, x:x + 32] = 255
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = k
            out.mux(stream.encode(frame))
            if track is not None:
                track.mux_until((k + 1) / HD["fps"])
        out.mux(stream.encode(None))
        if track is not None:
            track.close()
    return buf.getvalue()


class _SoundTrack:
    """AAC 48 kHz stereo tone bursts (four a second, random pitch) muxed up to a time."""

    RATE, STEP = 48000, 1024

    def __init__(self, out: av.container.OutputContainer, seconds: int, seed: int) -> None:
        rng = np.random.default_rng(seed + 1)
        t = np.arange(seconds * self.RATE) / self.RATE
        pitch = np.repeat(rng.choice([330.0, 660.0, 1320.0], seconds * 4), self.RATE // 4)[:len(t)]
        gate = (t * 4 % 1.0) < 0.5
        self.wave = (0.3 * np.sin(2 * np.pi * pitch * t) * gate).astype(np.float32)
        self.out = out
        self.stream = out.add_stream("aac", rate=self.RATE, layout="stereo")
        self.stream.bit_rate = 128_000
        self.pos = 0

    def mux_until(self, seconds: float) -> None:
        end = min(len(self.wave), int(seconds * self.RATE))
        while self.pos < end:
            piece = np.ascontiguousarray(np.stack([self.wave[self.pos:self.pos + self.STEP]] * 2))
            frame = av.AudioFrame.from_ndarray(piece, format="fltp", layout="stereo")
            frame.sample_rate, frame.pts = self.RATE, self.pos
            self.out.mux(self.stream.encode(frame))
            self.pos += self.STEP

    def close(self) -> None:
        self.mux_until(len(self.wave) / self.RATE)
        self.out.mux(self.stream.encode(None))


_AUDIO_CODECS = {"wav": ("wav", "pcm_s16le"), "mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"),
                 "flac": ("flac", "flac"), "m4a": ("mp4", "aac")}  # m4a: AAC in MP4, its moov last (a voice memo)


def make_audio(seconds: int, seed: int, fmt: str) -> bytes:
    """Mono noise shaped like speech (bursts of band-limited noise), 16 kHz (Opus: 48 kHz), as ``fmt``."""
    container, codec = _AUDIO_CODECS[fmt]
    rate = 48000 if fmt == "opus" else 16000
    rng = np.random.default_rng(seed)
    n = seconds * rate
    envelope = np.repeat(rng.uniform(0.05, 0.6, n // (rate // 5) + 1), rate // 5)[:n]
    wave = (np.convolve(rng.standard_normal(n), np.ones(8) / 8, mode="same") * envelope).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        fmt_name = stream.codec_context.codec.audio_formats[0].name
        step = stream.codec_context.frame_size or 1024
        resampler = av.AudioResampler(format=fmt_name, layout="mono", rate=rate)
        for start in range(0, n, step):
            frame = av.AudioFrame.from_ndarray(wave[None, start:start + step].copy(), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, start
            for piece in resampler.resample(frame):
                out.mux(stream.encode(piece))
        out.mux(stream.encode(None))
    return buf.getvalue()


def pyav_decode_audio(data: bytes) -> float:
    """Seconds plain PyAV needs to decode and resample every sample to 16 kHz."""
    t0 = time.perf_counter()
    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="fltp", layout="mono", rate=16000)
        for frame in container.decode(audio=0):
            frame.pts = None
            resampler.resample(frame)
    return time.perf_counter() - t0


def first_token(base_url: str, model: str, url: str, part: str = "video_url") -> float:
    question = "What happens in this video?" if part == "video_url" else "What do you hear?"
    return first_token_s(base_url, {
        "model": model, "max_tokens": 1, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": [{"type": part, part: {"url": url}},
                                                  {"type": "text", "text": question}]}]})


def server_counts(base_url: str) -> dict[str, float]:
    """The early-decode counters of a server (``early_*``) and its largest event-loop lag so far
    (``loop_lag_max_s``)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "mmserve_event_loop_lag_max_seconds":
            out["loop_lag_max_s"] = max(s.value for s in family.samples)
        elif family.name.startswith("mmserve_media_early"):
            for s in family.samples:
                key = s.name.removeprefix("mmserve_media_").removesuffix("_total")
                out[key] = out.get(key, 0.0) + s.value
    return out


def ttft_pair(media: bytes, warm: bytes, reps: int, rate: float, part: str,
              floor: Callable[[bytes], float]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """TTFT of ``media`` with and without decode-while-receiving, ``reps`` times each on fresh
    servers (after ``warm``), and ``floor(media)`` once per repetition; the early server's counters,
    and each variant's worst event-loop lag (``lag_<name>``: the servers' max gauges, start-up and
    the warm-up request included)."""
    times: dict[str, list[float]] = {"early": [], "after": [], "floor": [], "lag_early": [], "lag_after": []}
    counts: dict[str, float] = {}
    flags = ["--model", str(DEMO), "--allow-http", "--allowed-domains", "127.0.0.1", "--allow-private-hosts",
             "--fetch-timeout-s", "120"]
    with ThrottledMediaServer({"/media": media, "/warm": warm}, rate_bytes_s=rate) as host:
        for _ in range(reps):
            for name, extra in (("early", []), ("after", ["--no-decode-while-receiving"])):
                with ServerProcess([*flags, *extra]) as server:
                    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    first_token(server.base_url, model, host.url("/warm"), part)  # first-request costs
                    times[name].append(first_token(server.base_url, model, host.url("/media"), part))
                    seen = server_counts(server.base_url)
                    times[f"lag_{name}"].append(seen.pop("loop_lag_max_s", float("nan")))
                    if name == "early":
                        counts = seen
            times["floor"].append(floor(media))
    return times, counts


def _ttft_keys(times: dict[str, list[float]], size: int, rate: float) -> dict[str, float]:
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"ttft_early_s": med["early"], "ttft_after_s": med["after"], "ttft_ratio": med["early"] / med["after"],
            "loop_lag_max_early_ms": 1e3 * max(times["lag_early"]), "loop_lag_max_after_ms": 1e3 * max(times["lag_after"]),
            "ttft_early_spread_s": max(times["early"]) - min(times["early"]),
            "ttft_after_spread_s": max(times["after"]) - min(times["after"]),
            "arrival_s": size / rate, "size_mb": size / 1e6}


def run(seconds: int, reps: int, rate: float, layout: str, sound: bool = False, h264: bool = False) -> dict[str, float]:
    make = (lambda s, seed: make_h264(s, seed=seed)) if h264 else (lambda s, seed: make_camera_video(s, seed, sound=sound))
    video = remux_layout(make(seconds, 400), layout)
    warm = remux_layout(make(2, 401), layout)
    times, counts = ttft_pair(video, warm, reps, rate, "video_url", pyav_decode_all)
    out = {**_ttft_keys(times, len(video), rate), "pyav_all_frames_s": float(np.median(times["floor"])),
           "early_frames_used": counts.get("early_frames_used", 0.0),
           "early_frames_decoded_after": counts.get("early_frames_decoded_after", 0.0),
           "early_frames_decoded": counts.get("early_frames_decoded", 0.0),
           "early_packets_skipped": counts.get("early_packets_skipped", 0.0),
           "early_decode_bytes_outstanding_mb": counts.get("early_decode_bytes_outstanding", 0.0) / 1e6}
    if sound:
        out.update(pyav_sound_decode_s=pyav_decode_audio(video), early_sound_used=counts.get("early_sound_used", 0.0))
    return out


def run_audio(seconds: int, reps: int, rate: float, fmt: str) -> dict[str, float]:
    audio, warm = make_audio(seconds, seed=410, fmt=fmt), make_audio(2, seed=411, fmt=fmt)
    times, counts = ttft_pair(audio, warm, reps, rate, "audio_url", pyav_decode_audio)
    return {**_ttft_keys(times, len(audio), rate), "pyav_decode_s": float(np.median(times["floor"])),
            "early_audio_used": counts.get("early_audio_used", 0.0),
            "early_decode_bytes_outstanding_mb": counts.get("early_decode_bytes_outstanding", 0.0) / 1e6}


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=None, metavar="N", help="repetitions (medians; default 1 quick, 3 full)")
    parser.add_argument("--rate-mb-s", type=float, default=30.0, help="the media host's send rate in MB/s")
    parser.add_argument("--layout", choices=["fragments", "fragments-sidx", "index", "index-at-end", "matroska"], nargs="*",
                        default=["index", "fragments"], help="video container layouts, each its own rows")
    parser.add_argument("--seconds", type=int, default=None, help="video length (default 20 quick, 60 full)")
    parser.add_argument("--sound", action="store_true", help="videos with a sound track (keys <layout>_sound_)")
    parser.add_argument("--h264", action="store_true", help="the video is H.264 with B-frames, a camera pan "
                        "(pipeline.py's make_h264; keys <layout>_h264_), not MPEG-4 part 2 without B-frames")
    parser.add_argument("--audio", choices=sorted(_AUDIO_CODECS), nargs="*", default=["wav"],
                        help="audio formats, each its own rows")
    parser.add_argument("--audio-seconds", type=int, default=60, help="audio length (the demo context holds ~80 s)")
    parser.add_argument("--audio-rate-kb-s", type=float, default=256.0, help="the media host's rate for audio, KB/s")
    args = parser.parse_args()
    reps = args.repeat or (1 if args.quick else 3)
    seconds = args.seconds or (20 if args.quick else 60)
    results: dict[str, float] = {}
    if args.h264 and args.sound:
        parser.error("--h264 clips have no sound track")
    for layout in args.layout:
        one = run(seconds, reps, args.rate_mb_s * 1e6, layout, args.sound, args.h264)
        name = f"{layout}_sound" if args.sound else f"{layout}_h264" if args.h264 else layout
        print_table(f"decode while receiving: {seconds} s 720p{' with sound' if args.sound else ''}"
                    f"{' H.264' if args.h264 else ''}, {layout}, "
                    f"at {args.rate_mb_s:g} MB/s (median of {reps})", ["metric", "value"], sorted(one.items()))
        results.update({f"{name}_{k}": v for k, v in one.items()})
    for fmt in args.audio:
        one = run_audio(args.audio_seconds, reps, args.audio_rate_kb_s * 1e3, fmt)
        print_table(f"decode while receiving: {args.audio_seconds} s audio, {fmt}, at {args.audio_rate_kb_s:g} KB/s "
                    f"(median of {reps})", ["metric", "value"], sorted(one.items()))
        results.update({f"audio_{fmt}_{k}": v for k, v in one.items()})
    write_json(args.json, {**results, "seconds": seconds, "repeat": reps, "rate_mb_s": args.rate_mb_s, "sound": args.sound,
                           "audio_seconds": args.audio_seconds, "audio_rate_kb_s": args.audio_rate_kb_s})


if __name__ == "__main__":
    main()
