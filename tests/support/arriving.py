"""Helpers for the decode-while-arriving tests: a throttled sender into an ``ArrivingBytes``, a
PyAV remux into another container (fragmented MP4 and the like), an ingest from a throttled
loopback host with early decodes on, and the check that an early decode's frames equal the
whole-bytes decode chunk by chunk."""

from __future__ import annotations

import asyncio
import io
import tempfile
import threading
import time
from pathlib import Path

import av
import torch

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.early import EarlyDecoders, EarlyVideoDecode
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.decode.video_chunks import chunks_for_early, decode_chunk, decode_chunk_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.ingest import MediaIngestor
from mm_pipeline.media.ingest_config import IngestConfig, MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind, MediaSource
from samples.synthetic.throttled_http import ThrottledMediaServer, remux_layout
from tests.support.media_samples import video_bytes


def layout_clips(size: tuple[int, int], layouts: tuple[str, ...]) -> dict[str, bytes]:
    """One 12 s MPEG-4 clip of ``size`` (10 fps, a keyframe every second) remuxed into each of
    ``layouts`` (``remux_layout``'s names)."""
    base = video_bytes("mp4", fps=10, n_frames=120, size=size, gop=10)
    return {layout: remux_layout(base, layout) for layout in layouts}


def feed(body: ArrivingBytes, data: bytes, chunk: int = 2048, pause_s: float = 0.002,
         stop_at: int | None = None) -> threading.Thread:
    """A throttled sender on its own thread; ``stop_at``: fail the body after that many bytes."""
    def run() -> None:
        for i in range(0, len(data), chunk):
            if stop_at is not None and i >= stop_at:
                body.fail()
                return
            body.feed(data[i:i + chunk])
            time.sleep(pause_s)
        body.finish()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def start_early(data: bytes, layout: str, sampling: VideoSamplingParams, threads: int = 1,
                **feed_kw) -> tuple[EarlyVideoDecode, ArrivingBytes, threading.Thread]:
    """An early video decode of ``data`` in ``layout`` started once its first bytes arrived from a
    ``feed`` sender (``feed_kw``): the decode, its body and the sender (join it to wait for the end)."""
    body = ArrivingBytes(1 << 24, stall_s=5.0)
    sender = feed(body, data, **feed_kw)
    while body.received == 0:
        time.sleep(0.001)
    early = EarlyVideoDecode(body, layout, sampling, max_kept_bytes=1 << 26, timeout_s=30.0, threads=threads)
    early.start()
    return early, body, sender


def remux(data: bytes, fmt: str, movflags: str, kind: str = "video") -> bytes:
    """The first ``kind`` stream of ``data`` copied (no re-encode) into a ``fmt`` file muxed with
    ``movflags`` (e.g. "frag_keyframe+empty_moov")."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"clip.{fmt}"
        with av.open(io.BytesIO(data)) as src, av.open(str(path), "w", format=fmt,
                                                         options={"movflags": movflags}) as out:
            source = getattr(src.streams, kind)[0]
            stream = out.add_stream_from_template(source)
            for packet in src.demux(source):
                if packet.dts is not None:
                    packet.stream = stream
                    out.mux(packet)
        return path.read_bytes()


def early_chunks_match_whole(early, item, info, indices, chunks, tp: int, size) -> int:
    """Every chunk decoded from the early decoder equals the whole-bytes decode; returns how many
    frames the early decoder supplied."""
    used = 0
    for groups in chunks:
        whole = decode_chunk(item, info, indices, groups, tp, MediaLimits(), size)
        streamed, n = decode_chunk_early(early, item, info, indices, groups, tp, size, None)
        assert torch.equal(streamed, whole)
        used += n
    return used


def ingest_throttled(data: bytes, sampling: VideoSamplingParams, seconds: float = 0.6,
                     **host) -> tuple[MediaItem, dict[str, int], ThrottledMediaServer]:
    """``data`` ingested as a video from a throttled loopback host (sent in ``seconds``, 2 KiB
    chunks) with early decodes on: the item, the ingestor's counts and the host (closed; its
    ``range_requests`` / ``range_asks`` say what was asked of it)."""
    ingestor = MediaIngestor(IngestConfig(allow_remote=True, allowed_domains=("127.0.0.1",),
                                          allow_private_hosts=True, fetch_timeout_s=10.0))
    decoders = EarlyDecoders(sampling, MediaLimits(), fetch_timeout_s=10.0)
    ingestor.early_decode = lambda body, layout, kind, origin: decoders.start(body, layout, kind, origin)
    with ThrottledMediaServer({"/v.mp4": data}, rate_bytes_s=len(data) / seconds, chunk=2048, **host) as media:
        item = asyncio.run(ingestor.ingest(MediaSource(url=media.url("/v.mp4"), kind=MediaKind.VIDEO)))
    return item, ingestor.counts, media


def early_covers_whole(item: MediaItem, sampling: VideoSamplingParams) -> None:
    """``item``'s early decode started before the last byte, and every sampled frame came from it,
    equal to the whole-bytes decode."""
    early = item.early
    assert isinstance(early, EarlyVideoDecode)
    assert early.received_at_start < item.nbytes  # started before the last byte
    assert early.join(10.0)
    assert early.received_at_first_frame is not None and early.received_at_first_frame < item.nbytes
    info = probe_video(item)
    sampled = sample_frames(info.total_frames, info.video_fps, sampling)
    tp, size = 2, (32, 48)
    chunks = plan_chunks(list(range(sampled.num_frames // tp)), sampled.indices, info.keyframes, tp, 2)
    assert chunks_for_early(early, info, sampled.indices, chunks, tp) == set(range(len(chunks)))
    used = early_chunks_match_whole(early, item, info, sampled.indices, chunks, tp, size)
    assert used == len(set(sampled.indices))
