"""Remote fetch at its edges: URLs no client can fetch are a 400, not a 500, an early decode
started on a body is stopped (its share of the decode budget given back) however the fetch ends,
and a content-encoded body (a decompression bomb) is refused before anything is inflated."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import tracemalloc
import zlib

import httpx
import pytest

from mm_pipeline.errors import InvalidMediaError, MediaFetchError, MediaFetchTimeout
from mm_pipeline.media.decode.early import EarlyDecoders
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.media.ingest import MediaIngestor
from mm_pipeline.media.ingest_config import IngestConfig, MediaLimits
from mm_pipeline.media.types import MediaKind, MediaSource
from mm_pipeline.server.errors import http_answer
from tests.support.media_samples import audio_bytes

WAV = audio_bytes("wav", seconds=2.0)


def _ingestor(transport: httpx.AsyncBaseTransport | None = None, timeout_s: float = 5.0) -> MediaIngestor:
    return MediaIngestor(IngestConfig(allow_remote=True, allowed_domains=("127.0.0.1", "media.example"),
                                      allow_private_hosts=True, fetch_timeout_s=timeout_s), transport=transport)


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999/x", "http://127.0.0.1:0x/x",
                                 "http://media.example/a\x00.png", "http://[127.0.0.1]/x"])
def test_a_url_no_client_can_fetch_is_invalid_media(url: str) -> None:
    """urllib and httpx raised ValueError / InvalidURL / OverflowError here: a 500 with a traceback."""
    with pytest.raises(InvalidMediaError, match="not a valid http") as info:
        asyncio.run(_ingestor().ingest(MediaSource(url=url)))
    assert http_answer(type(info.value)).status == 400


def test_every_redirect_hop_is_checked_the_same_way() -> None:
    class Redirect(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(302, headers={"location": "http://127.0.0.1:99999/x"})

    with pytest.raises(InvalidMediaError, match="99999/x is not a valid") as info:
        asyncio.run(_ingestor(Redirect()).ingest(MediaSource(url="http://media.example/a.wav")))
    assert http_answer(type(info.value)).status == 400


class _SlowClose(httpx.AsyncBaseTransport):
    """A whole WAV body in 8 KiB pieces, then a connection pool that takes 0.3 s to close: the
    fetch is cancelled (or runs out of time) after the body arrived and the early decode started."""

    def __init__(self) -> None:
        self.closing = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async def body():
            for i in range(0, len(WAV), 8192):
                await asyncio.sleep(0.002)
                yield WAV[i:i + 8192]
        return httpx.Response(200, headers={"content-length": str(len(WAV))}, content=body())

    async def aclose(self) -> None:
        self.closing.set()
        await asyncio.sleep(0.3)


@pytest.mark.parametrize("end", ["cancel", "deadline"])
def test_an_early_decode_is_stopped_when_the_fetch_ends_after_its_body(end: str) -> None:
    """Before, the started decode was dropped with the body's (data, key, decode) tuple: never
    cancelled, it kept what it had taken of the decode budget for good."""
    decoders = EarlyDecoders(VideoSamplingParams(), MediaLimits(), fetch_timeout_s=5.0, audio_rate=16000)
    started = []

    async def main() -> None:
        transport = _SlowClose()
        ingestor = _ingestor(transport, timeout_s=0.25 if end == "deadline" else 5.0)
        ingestor.early_decode = lambda *args: started.append(decoders.start(*args)) or started[-1]
        task = asyncio.create_task(ingestor.ingest(MediaSource(url="http://media.example/a.wav",
                                                               kind=MediaKind.AUDIO)))
        if end == "cancel":
            await transport.closing.wait()
            task.cancel()
        with pytest.raises(asyncio.CancelledError if end == "cancel" else MediaFetchTimeout):
            await task

    asyncio.run(main())
    assert started and started[0] is not None
    started[0].join(10)
    assert started[0].control.cancelled and decoders.budget.early_in_use == 0


def _serve_once(head: bytes, body: bytes) -> tuple[int, list[bytes]]:
    """A one-shot HTTP server on 127.0.0.1 answering ``head`` + ``body``; the requests it got."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    requests: list[bytes] = []

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                requests.append(conn.recv(65536))
                conn.sendall(head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                conn.settimeout(2)
                try:
                    conn.recv(1)  # until the client hangs up
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], requests


def _gzip(chunks: int, layers: int) -> bytes:
    """``chunks`` MiB of zeros gzipped ``layers`` times, without ever holding the zeros whole."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    data = b"".join(packer.compress(bytes(1 << 20)) for _ in range(chunks)) + packer.flush()
    for _ in range(layers - 1):
        data = gzip.compress(data, 9)
    return data


@pytest.mark.parametrize("encoding", ["gzip, gzip", "gzip"])
def test_a_content_encoded_body_is_refused_before_anything_is_inflated(encoding: str) -> None:
    """A few KiB of ``Content-Encoding: gzip, gzip`` inflate to 32 MiB: httpx decoded each raw
    chunk whole, with no bound, before the 64 KiB size cap saw it (the audit inflated 300 MiB into
    one bytes object on the event loop). Now identity is asked for, the raw bytes are read and an
    encoded answer is a 400 at once; nothing is inflated."""
    body = _gzip(32, layers=encoding.count("gzip"))
    assert len(body) < 64 << 10
    port, requests = _serve_once(b"HTTP/1.1 200 OK\r\nContent-Type: video/mp4\r\n"
                                 + f"Content-Encoding: {encoding}\r\n".encode(), body)
    ingestor = MediaIngestor(IngestConfig(allow_remote=True, allowed_domains=("127.0.0.1",), allow_private_hosts=True,
                                          fetch_timeout_s=5.0, limits=MediaLimits(max_bytes=64 << 10)))
    tracemalloc.start()
    try:
        with pytest.raises(MediaFetchError, match="Content-Encoding") as info:
            asyncio.run(ingestor.ingest(MediaSource(url=f"http://127.0.0.1:{port}/v.mp4", kind=MediaKind.VIDEO)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert http_answer(type(info.value)).status == 400
    assert peak < 8 << 20, f"{peak >> 20} MiB allocated fetching a {len(body)}-byte body"
    assert b"accept-encoding: identity" in requests[0].lower()
