r"""Bytes that are still arriving (an http(s) body, an upload), readable while they grow.

    receiver (event loop) ── feed(chunk) ──► ArrivingBytes ──► blake3, chunk by chunk (the content key)
                                                   │
                                                   └──► ArrivingReader.read / seek (a decoder thread):
                                                        waits for more bytes or the end

One buffer holds the bytes once: the decoder reads slices of it, and ``finish`` hands the whole body
on as the media item's ``data`` (the same bytes the hash saw, so the key of a streamed item is the
key of the same bytes given whole). ``max_bytes`` is enforced as the chunks arrive. The buffer is an
``io.BytesIO``, whose ``getvalue`` returns its own bytes object without copying: a ``bytearray``
had to be copied into ``bytes`` at the end, on the event loop and on the path to the first token
(45 MB: 21 ms on an idle core, 25-150 ms measured while the early decoder kept the other core busy).
Readers copy their slices out through a short-lived buffer export (an export blocks the writes
that grow the buffer, so none outlives the lock), or from the finished bytes once there are any
(an export of a buffer ``getvalue`` has shared would copy it whole).

A reader never waits for good: every wait ends at the end of the body, at ``fail`` (the receiver
gave up: a stalled or disconnected client, a size or time limit), at ``close`` or after
``stall_s`` seconds without a new byte, and raises ``ArrivalAborted`` in the last three cases. A
seek past what has arrived waits like a read (an MP4 whose index is at the end would wait for it:
``streamable_layout`` spots those before a decoder is started, and one starts only once that
index is in, below).

The end of the body may be put in early (``put_tail``: an MP4 whose index follows its samples,
fetched with an HTTP range while the samples still arrive, media.index_from_end): a read at or past its
offset is answered from it at once, and a size query answers the declared size. The tail is only
trusted once the body has arrived: ``finish`` compares it with the body's own end
(``tail_mismatch``: the decoder that read it must drop what it decoded) and lets it go.

Two knobs per reader, because demuxers behave differently on what they are told (both measured,
README "Decoding while bytes arrive"): ``seekable=False`` makes FFmpeg read as from a pipe (an
Ogg demuxer that may seek would jump to the last page for the duration and wait for the last
byte); ``known_size=True`` answers a size query with the declared size (Content-Length) before the
end has arrived -- the MP3 demuxer trims the encoder's end padding only when it knows the size, so
without it the last frame's samples differ from a decode of the whole bytes.
"""

from __future__ import annotations

import io
import threading
import time
from contextlib import AbstractContextManager, nullcontext

import blake3

from mm_pipeline.errors import MediaError, MediaTooLarge


class ArrivalAborted(MediaError):
    """The bytes stopped arriving before their end (receiver failed, closed, or stalled)."""


class ArrivingBytes:
    """A growing, size-capped body with its incremental content key. ``feed``/``finish``/``fail``
    come from the receiver; any number of ``reader()``s read from other threads."""

    def __init__(self, max_bytes: int, stall_s: float, declared_size: int | None = None) -> None:
        if max_bytes <= 0 or not stall_s > 0:
            raise ValueError(f"ArrivingBytes needs max_bytes > 0 and stall_s > 0, got {max_bytes}, {stall_s}")
        if declared_size is not None and not 0 <= declared_size <= max_bytes:
            raise ValueError(f"ArrivingBytes declared_size must lie in [0, {max_bytes}], got {declared_size}")
        self.max_bytes = max_bytes
        self.stall_s = stall_s
        self.declared_size = declared_size  # what the sender said it will send (Content-Length), unchecked
        self._buf = io.BytesIO()  # written at its end only (module doc)
        self._size = 0
        self._whole: bytes | None = None  # the body, once finished
        self._tail: bytes | None = None  # the body's end from ``_tail_at`` on, fetched on its own (put_tail)
        self._tail_at = 0
        self.tail_mismatch = False  # set by finish: the tail put in was not the body's end
        self._hasher = blake3.blake3()
        self._cond = threading.Condition()
        self._last_arrival = time.monotonic()  # when the last byte came (stall_s is timed from it)
        self._done = False
        self._error: BaseException | None = None

    # ---- receiver side ----------------------------------------------------------------------
    def feed(self, chunk: bytes) -> None:
        if self._size + len(chunk) > self.max_bytes:
            error = MediaTooLarge(f"media is over the {self.max_bytes}-byte limit")
            self.fail(error)
            raise error
        self._hasher.update(chunk)  # the same bytes, in the same order, as the decoder sees
        with self._cond:
            if self._done or self._error is not None:
                raise ValueError("ArrivingBytes.feed after finish/fail")
            self._buf.write(chunk)
            self._size += len(chunk)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()

    def finish(self) -> tuple[bytes, str]:
        """The whole body and its content key (blake3 hex, as ``content_key`` of the same bytes)."""
        with self._cond:
            if self._error is not None:
                raise ArrivalAborted(f"the media stopped arriving ({self._error})")
            self._done = True
            self._whole = self._buf.getvalue()  # no copy (module doc)
            if self._tail is not None:
                self.tail_mismatch = memoryview(self._whole)[self._tail_at:] != self._tail  # (no copy)
                self._tail = None
            self._cond.notify_all()
            return self._whole, self._hasher.hexdigest()

    def put_tail(self, offset: int, tail: bytes) -> None:
        """The body's bytes from ``offset`` to its declared end, received on their own (module doc)."""
        if self.declared_size is None or offset < 0 or offset + len(tail) != self.declared_size:
            raise ValueError(f"a tail must end at the declared size {self.declared_size}, got "
                             f"{len(tail)} bytes at {offset}")
        with self._cond:
            if not self._done and self._error is None:
                self._tail, self._tail_at = tail, offset
                self._cond.notify_all()

    def tail_slice(self, start: int, size: int) -> bytes | None:
        """Up to ``size`` bytes at ``start`` from the tail, or None: no tail, or it does not hold
        ``start`` (a read waits for the body then)."""
        with self._cond:
            if self._tail is None or start < self._tail_at or self._error is not None:
                return None
            return self._tail[start - self._tail_at:start - self._tail_at + size]

    @property
    def has_tail(self) -> bool:
        with self._cond:
            return self._tail is not None

    def fail(self, error: BaseException | None = None) -> None:
        """The body will not be completed: wake every reader with ``ArrivalAborted``; frees the buffer."""
        with self._cond:
            if self._error is None:
                self._error = error or ArrivalAborted("the media stopped arriving")
            self._drop()
            self._cond.notify_all()

    close = fail

    def _drop(self) -> None:
        self._buf, self._size, self._whole, self._tail = io.BytesIO(), 0, None, None

    # ---- reader side ------------------------------------------------------------------------
    @property
    def received(self) -> int:
        with self._cond:
            return self._size

    @property
    def done(self) -> bool:
        with self._cond:
            return self._done

    def head(self, n: int) -> bytes:
        with self._cond:
            with self._view() as view:
                return bytes(view[:n])

    @property
    def size_as_declared(self) -> bool:
        """The body ended with exactly ``declared_size`` bytes (what a ``known_size`` reader assumed)."""
        with self._cond:
            return self._done and self._error is None and self._size == self.declared_size

    def reader(self, seekable: bool = True, known_size: bool = False) -> "ArrivingReader":
        """``seekable``: False reads as from a pipe; ``known_size``: a size query answers
        ``declared_size`` before the end (module doc)."""
        return ArrivingReader(self, seekable, known_size and self.declared_size is not None)

    def wait_for(self, end: int | None) -> int:
        """Block until ``end`` bytes arrived (None: the whole body) or the body ended; the bytes
        available then. Raises ``ArrivalAborted`` on ``fail`` or a stall of ``stall_s``."""
        with self._cond:
            while not self._done and (end is None or self._size < end):
                if self._error is not None:
                    break
                # the stall is timed from the last byte, not from this wake-up: other news (a
                # tail put in) wakes the readers too without any byte having arrived
                left = self._last_arrival + self.stall_s - time.monotonic()
                if left <= 0:
                    self._error = ArrivalAborted(f"no media byte arrived for {self.stall_s} s")
                    self._drop()
                    break
                self._cond.wait(left)
            if self._error is not None:
                raise ArrivalAborted(f"the media stopped arriving ({self._error})")
            return self._size

    def slice(self, start: int, stop: int) -> bytes:
        with self._cond:
            if self._error is not None:
                raise ArrivalAborted(f"the media stopped arriving ({self._error})")
            with self._view() as view:
                return bytes(view[start:stop])

    def _view(self) -> AbstractContextManager[memoryview]:
        """The bytes so far as a buffer (under the lock, released before it: module doc)."""
        return nullcontext(memoryview(self._whole)) if self._whole is not None else self._buf.getbuffer()


class ArrivingReader(io.RawIOBase):
    """A blocking, seekable file object over ``ArrivingBytes`` (what PyAV reads from)."""

    def __init__(self, source: ArrivingBytes, seekable: bool = True, known_size: bool = False) -> None:
        super().__init__()
        self._src = source
        self._pos = 0
        self._seekable = seekable
        self._known_size = known_size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable  # PyAV asks once, when it opens: False gives FFmpeg no seek function

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        whole = size is None or size < 0
        if not whole and (early := self._src.tail_slice(self._pos, size)) is not None:
            self._pos += len(early)
            return early
        # whatever has arrived past the position, at least one byte: the demuxer asks for a block
        # and takes less, so decoding follows the bytes instead of waiting for a full block
        available = self._src.wait_for(None if whole else self._pos + 1)
        data = self._src.slice(self._pos, available if whole else min(self._pos + size, available))
        self._pos += len(data)
        return data

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            target = offset
        elif whence == io.SEEK_CUR:
            target = self._pos + offset
        elif whence == io.SEEK_END:
            # FFmpeg asks for the size this way (avio_size) all the time: before the end has
            # arrived the size is unknown (-1: FFmpeg reads on as from a pipe) unless the reader
            # trusts the declared size; never wait here
            if self._src.done:
                target = self._src.received + offset
            elif self._known_size or self._src.has_tail:  # (a tail ends at the declared size)
                target = self._src.declared_size + offset  # type: ignore[operator]
            else:
                return -1
        else:
            raise OSError(f"unsupported whence {whence}")
        if target < 0:
            raise OSError(f"seek to a negative offset {target}")
        self._pos = target
        return target
