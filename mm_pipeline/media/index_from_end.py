r"""An MP4 whose index comes after its samples, decoded while it arrives all the same.

FFmpeg's default MP4 output and most cameras and phones write the samples (``mdat``) first and
the index (``moov``) last. Sent front to back, nothing of it can be decoded before the last bytes,
so such a video used to be decoded only after arrival. Its first bytes say where the index begins
(the end of the ``mdat``: ``sniff.index_after_samples``), so the index is fetched on its own with
an HTTP range request for the rest of the file, beside the body still arriving, as a browser does
to play such a file; once it is in, the early decoder starts as for a ``moov``-first MP4 and
follows the samples as they arrive:

    GET  url ───────────── ftyp mdat[samples ...................] moov ──► body (hash, data)
    GET  url Range: bytes=end_of_mdat- ──► moov ──► ArrivingBytes.put_tail ──► early decoder
                                                    (reads at/after the offset come from the tail)

Only when the host honours the range exactly (206 with ``Content-Range: bytes a-b/size`` of the
size the body declared, no content encoding) and the rest of the file is at most
``sniff.MAX_INDEX_BYTES`` (16 MiB; more: decoded after arrival); any other answer, an error or a tail
still missing when the body has arrived changes nothing but the early start. The tail is trusted
only once the body is whole: ``ArrivingBytes.finish`` compares it with the body's own end, and a
mismatch (the file changed between the two requests) cancels the early decode, whose frames are
dropped before planning takes any. The range request goes to the URL the body came from (after
redirects, so through the same host checks), on the same client, inside the same fetch deadline. FFmpeg
reads forward instead of seeking when the jump is short (under ~64 KB, its buffer and short-seek
threshold), so a clip whose samples are that small is read through to its index anyway: it gains
nothing, and loses nothing.
"""

from __future__ import annotations

import asyncio
import io
from typing import Awaitable, Callable

import httpx

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.sniff import MAX_INDEX_BYTES, index_after_samples


async def fetch_range(client: httpx.AsyncClient, url: str, offset: int, size: int) -> bytes | None:
    """Bytes ``offset`` to ``size - 1`` of ``url`` by one range request, or None: the host answered
    anything but exactly those bytes of a ``size``-byte body."""
    expect = f"bytes {offset}-{size - 1}/{size}"
    async with client.stream("GET", url, headers={"Range": f"bytes={offset}-", "Accept-Encoding": "identity"}) as r:
        if (r.status_code != 206 or r.headers.get("content-range") != expect
                or r.headers.get("content-encoding", "identity") != "identity"):
            return None
        got = io.BytesIO()  # getvalue hands its bytes on without a copy (ArrivingBytes does the same)
        async for chunk in r.aiter_bytes():
            got.write(chunk)
            if got.tell() > size - offset:
                return None
    return got.getvalue() if got.tell() == size - offset else None


class IndexFromEnd:
    """One body's index fetched from its end (module doc): ``start`` once the layout is known not
    to stream; ``ready`` after each chunk (True once: the tail is in the body, start the decoder);
    ``close`` when the body has ended, whatever happened."""

    def __init__(self, body: ArrivingBytes, offset: int, task: asyncio.Task[bytes | None]) -> None:
        self.body = body
        self.offset = offset
        self._task = task
        self._taken = False

    @classmethod
    def start(cls, body: ArrivingBytes, head: bytes,
              fetch: Callable[[int, int], Awaitable[bytes | None]]) -> "IndexFromEnd | None":
        """Fetch the rest of ``body`` after its ``mdat`` with ``fetch(offset, size)``, or None: not
        such an MP4, no declared size, or too much to fetch. ``head``: the first bytes that told the
        layout (``sniff.streamable_layout``), so the ``mdat`` header is in it however many boxes
        precede it (a camera's metadata ``uuid`` or a reserved ``free`` box run to kilobytes)."""
        size = body.declared_size
        offset = index_after_samples(head, size) if size else None
        if offset is None or size is None or size - offset > MAX_INDEX_BYTES:
            return None
        return cls(body, offset, asyncio.ensure_future(fetch(offset, size)))

    def ready(self) -> bool:
        if self._taken or not self._task.done():
            return False
        self._taken = True
        tail = None if self._task.cancelled() or self._task.exception() is not None else self._task.result()
        if tail is None:
            return False
        self.body.put_tail(self.offset, tail)
        return self.body.has_tail  # (not after the body ended or failed)

    async def close(self) -> None:
        """Stop the range request if it still runs, and wait for it (the client it uses closes next)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
