"""Helpers for the decode-while-arriving tests: a throttled sender into an ``ArrivingBytes``, a
PyAV remux into another container (fragmented MP4 and the like), and the check that an early
decode's frames equal the whole-bytes decode chunk by chunk."""

from __future__ import annotations

import io
import tempfile
import threading
import time
from pathlib import Path

import av
import torch

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.early import decode_chunk_early
from mm_pipeline.media.decode.video_chunks import decode_chunk
from mm_pipeline.media.ingest_config import MediaLimits


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
