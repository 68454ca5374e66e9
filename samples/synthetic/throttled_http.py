"""A loopback HTTP server that sends media at a throttled rate, for the decode-while-receiving
tests and benchmark (issue 16 item 4): ``with ThrottledMediaServer({"/clip.mp4": data}, rate=30e6)
as server: server.url("/clip.mp4")``. ``/cut/<name>`` sends half the body and closes the
connection (a sender that disconnects mid-way); ``/stall/<name>`` sends half and then nothing.
A ``Range: bytes=a-`` / ``bytes=a-b`` request gets 206 and those bytes at the same rate (as web
servers and object stores answer), unless ``ranges`` is False (200 and the whole body, as a host
without range support does); ``range_files`` answers ranges of a path from other bytes of the same
size (a file that changed between two requests). ``Accept-Ranges`` says which (``bytes`` /
``none``), unless ``advertise_ranges`` is False (no header, as many hosts send); ``range_requests``
counts the 206 answers, ``range_asks`` every request that asked for a range.
``remux_layout`` puts a video's coded frames into the container layouts the server streams."""

from __future__ import annotations

import http.server
import io
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import av

_MOVFLAGS = {"fragments": "frag_keyframe+empty_moov+default_base_moof", "index": "faststart",
             # FFmpeg's global_sidx: the whole duration up front (with absolute fragment offsets
             # FFmpeg 8 writes a file that does not decode, hence default_base_moof)
             "fragments-sidx": "frag_keyframe+empty_moov+global_sidx+default_base_moof"}


def remux_layout(data: bytes, layout: str) -> bytes:
    """The same coded video frames and sound (its first audio stream, if any; no re-encoding) as
    ``layout``: ``fragments`` (fragmented MP4, empty moov), ``fragments-sidx`` (the same with a
    leading sidx stating the duration), ``index`` (MP4, moov first), ``matroska``, ``index-at-end``
    (MP4, moov last). Through a file: faststart rewrites it. Packets are copied in the source's
    demux order, so the streams come out interleaved by time as the source has them."""
    fmt = "matroska" if layout == "matroska" else "mp4"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"clip.{fmt}"
        options = {"movflags": _MOVFLAGS[layout]} if layout in _MOVFLAGS else {}
        with av.open(io.BytesIO(data)) as src, av.open(str(path), "w", format=fmt, options=options) as out:
            sources = [src.streams.video[0], *src.streams.audio[:1]]
            copies = {s.index: out.add_stream_from_template(s) for s in sources}
            for packet in src.demux(*sources):
                if packet.dts is not None:  # the muxer's flush packet
                    packet.stream = copies[packet.stream.index]
                    out.mux(packet)
        return path.read_bytes()


class ThrottledMediaServer:
    def __init__(self, files: dict[str, bytes], rate_bytes_s: float = 30e6, chunk: int = 64 * 1024,
                 stall_s: float = 30.0, ranges: bool = True, range_files: dict[str, bytes] | None = None,
                 advertise_ranges: bool = True) -> None:
        if not rate_bytes_s > 0 or chunk < 1:
            raise ValueError(f"ThrottledMediaServer needs rate > 0 and chunk >= 1, got {rate_bytes_s}, {chunk}")
        self.files = files
        self.rate = rate_bytes_s
        self.chunk = chunk
        self.stall_s = stall_s
        self.ranges = ranges
        self.range_files = range_files or {}
        self.advertise_ranges = advertise_ranges  # False: no Accept-Ranges header (ranges or not)
        self.range_requests = 0  # range requests answered with 206
        self.range_asks = 0  # requests that asked for a range, however answered
        self._stop = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner._serve(self)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{path}"

    def __enter__(self) -> "ThrottledMediaServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        mode, _, name = handler.path.lstrip("/").partition("/")
        if mode not in ("cut", "stall"):
            mode, name = "", handler.path
        body = self.files.get(name if name.startswith("/") else "/" + name)
        if body is None:
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        self.range_asks += handler.headers.get("Range") is not None
        asked = _byte_range(handler.headers.get("Range"), len(body)) if self.ranges else None
        if asked is not None:
            first, last = asked
            size = len(body)
            body = self.range_files.get(name if name.startswith("/") else "/" + name, body)[first:last + 1]
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.range_requests += 1
        else:
            handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        if self.advertise_ranges:
            handler.send_header("Accept-Ranges", "bytes" if self.ranges else "none")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        end = len(body) // 2 if mode else len(body)
        start = time.monotonic()
        try:
            for pos in range(0, end, self.chunk):
                handler.wfile.write(body[pos:min(pos + self.chunk, end)])
                handler.wfile.flush()
                ahead = (pos + self.chunk) / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)  # the sender's rate, not the loopback's
            if mode == "stall":
                self._stop.wait(self.stall_s)
        except (BrokenPipeError, ConnectionResetError):
            pass
        handler.close_connection = True


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) of a single ``bytes=a-`` / ``bytes=a-b`` range within ``size``, else None."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    a, _, b = header[len("bytes="):].partition("-")
    if not a.isdigit() or (b and not b.isdigit()):
        return None
    first, last = int(a), min(int(b) if b else size - 1, size - 1)
    return (first, last) if first <= last else None
