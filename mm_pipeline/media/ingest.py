"""Ingest: turn a ``MediaSource`` (uploaded bytes, data URL, allowed local path, allowed remote URL)
into a ``MediaItem`` — raw bytes with a type sniffed from the content — enforcing byte limits.

Hash first: once the bytes are held, their content key (blake3) is computed before anything looks
inside them; the sniff answer of a content key seen before comes from a memo, so a repeated
container is never opened by PyAV again (and planning then finds its manifest by the same key).

An http(s) body is fetched by ``media.remote.fetch`` (its own security rules: allow-list, public
addresses only, redirects, deadline), hashed while it arrives and, for a streamable video or an
audio item, decoded while it arrives by the early decoder set in ``early_decode``.

Pixel, duration and frame limits need the media headers and are enforced by the decoders, before
any full decode, from the same ``MediaLimits``.

Security rules for local sources:
  * local files only under ``allowed_local_dirs``, checked after resolving symlinks and ``..``;
    regular files only (a FIFO or a device is refused before it is opened);
  * local paths are plain strings: a NUL byte is a 400, not an OS error.
"""

from __future__ import annotations

import binascii
import dataclasses
import os
import stat
import threading
import time
import urllib.parse
import urllib.request
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Callable, TypeVar

import httpx
import pybase64

from mm_pipeline.errors import (
    InvalidMediaError,
    MediaAccessDenied,
    MediaNotFound,
    MediaTooLarge,
    UnsupportedMediaType,
)
from mm_pipeline.media.content_hash import content_key
from mm_pipeline.media.ingest_config import IngestConfig
from mm_pipeline.media.remote.fetch import EarlyDecode, RemoteFetch, short_url
from mm_pipeline.media.sniff import SniffMemo, sniff
from mm_pipeline.media.types import DeferredMediaItem, MediaItem, MediaKind, MediaSource
from mm_pipeline.media.source_memo import DataUrlIds, SourceMemo, file_id
from mm_pipeline.media.worker_pool import WorkerPool

T = TypeVar("T")


class MediaIngestor:
    """Loads media sources.  ``ingest`` is the async entry point (blocking file reads and probes go
    to ``pool`` when given); ``ingest_local`` is the synchronous one for everything but http(s)."""

    def __init__(self, config: IngestConfig, pool: WorkerPool | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.pool = pool
        self._roots = tuple(Path(d).resolve() for d in config.allowed_local_dirs)
        self.sniff_memo = SniffMemo()
        # (body, layout, declared kind, origin) -> a started early decode or None: set by the
        # planner, which knows the sampling, audio rate and decoder settings (media.decode.early);
        # None: decode after arrival only
        self.early_decode: EarlyDecode | None = None
        self.source_memo = SourceMemo()
        self.data_url_ids = DataUrlIds()  # a repeated data URL's memo id without hashing its text again
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self.remote = RemoteFetch(config, self._count, transport)

    @property
    def counts(self) -> dict[str, int]:
        """Per modality (``name.kind``): content_hashes, sniff_probes (a PyAV open was needed),
        sniff_memo_hits (the content key answered, nothing opened), source_memo_hits (a data URL or
        file seen before: neither decoded, read nor hashed -- a DeferredMediaItem); early_decodes.video
        and .audio (decoding started while the bytes arrived) and early_decode_bytes_outstanding
        (bytes still to come then, summed); index_from_end (MP4s decoded early once their index was
        fetched from the end) and index_from_end_mismatches (that index was not the body's end: the
        early decode was dropped)."""
        with self._counts_lock:
            return dict(self._counts)

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1

    # ---- public API -------------------------------------------------------------------------

    async def ingest(self, source: MediaSource, salt: str | None = None) -> MediaItem:
        """``source`` loaded, hashed and sniffed. ``salt``: the request's cache_salt, which keeps
        its memo entries (sniff answers, remembered sources) apart from other salts'."""
        if source.url is not None and _scheme(source.url) in ("http", "https"):
            data, key, early = await self.remote.fetch(source.url, source.kind, self.early_decode)
            try:
                item = await self._off_loop(self._to_item, data, source.kind, short_url(source.url), key, salt)
            except BaseException:
                if early is not None:
                    early.cancel()
                raise
            return self._with_early(item, early)
        return await self._off_loop(self.ingest_local, source, salt)

    def ingests_locally(self, source: MediaSource) -> bool:
        """Whether ``ingest_local`` takes ``source``: everything but an http(s) URL (fetched by
        ``ingest`` on the event loop)."""
        return source.url is None or _scheme(source.url) not in ("http", "https")

    def ingest_local(self, source: MediaSource, salt: str | None = None) -> MediaItem:
        if source.data is not None:
            return self._to_item(source.data, source.kind, source.origin or "upload", salt=salt)
        if source.path is not None:
            return self._file_item(source.path, source.kind, salt)
        if source.base64 is not None:
            payload = source.base64
            return self._remembered(self.data_url_ids(payload, "base64", salt), source.kind, "base64 data",
                                    lambda: self._decode_base64(payload, "base64 payload"), salt=salt)
        url = source.url or ""
        scheme = _scheme(url)
        if scheme == "data":
            return self._remembered(self.data_url_ids(url, salt=salt), source.kind, "data-url", lambda: self._parse_data_url(url),
                                    salt=salt)
        if scheme == "file":
            parsed = urllib.parse.urlsplit(url)
            if parsed.netloc not in ("", "localhost"):
                raise InvalidMediaError(f"file URL names a remote host {parsed.netloc!r}")
            path = urllib.request.url2pathname(parsed.path)
            return self._file_item(path, source.kind, salt)
        if scheme in ("http", "https"):
            raise InvalidMediaError("http(s) media must be loaded with the async ingest()")
        raise InvalidMediaError(f"unsupported media URL scheme {scheme!r} (use data:, file:, http(s):)")

    # ---- internal helpers -------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args) if self.pool is None else await self.pool.run(fn, *args)

    def _to_item(self, data: bytes, declared: MediaKind | None, origin: str, key: str | None = None,
                 salt: str | None = None) -> MediaItem:
        """``key``: the content key when it was computed while the bytes arrived (http fetch)."""
        self._check_size(len(data))
        key = key or content_key(data)  # first: nothing has looked inside the bytes yet
        found = self.sniff_memo.get(key, salt)
        memo_hit = found is not None
        if found is None:
            found = sniff(data, self.config.limits.max_pixels)
            self.sniff_memo.put(key, found, salt)
        if declared is not None and declared not in found.kinds:
            raise UnsupportedMediaType(
                f"{origin} content is {found.format} ({', '.join(sorted(k.value for k in found.kinds))}),"
                f" not usable as {declared.value}"
            )
        kind = declared or found.primary
        with self._counts_lock:
            self._counts[f"content_hashes.{kind.value}"] += 1
            if memo_hit:
                self._counts[f"sniff_memo_hits.{kind.value}"] += 1
            elif found.probed:
                self._counts[f"sniff_probes.{kind.value}"] += 1
        return MediaItem(kind=kind, format=found.format, data=data, origin=origin, content_key=key)

    def _with_early(self, item: MediaItem, early: Any) -> MediaItem:
        if early is None:
            return item
        if item.kind is not early.kind:
            early.cancel()  # e.g. a Matroska started as a video that sniffed as audio
            return item
        item = dataclasses.replace(item, early=early)
        weakref.finalize(item, early.cancel)  # the request dropped its item: stop, free the frames
        with self._counts_lock:
            self._counts[f"early_decodes.{item.kind.value}"] += 1
            self._counts["early_decode_bytes_outstanding"] += item.nbytes - early.received_at_start
        return item

    def _remembered(self, source_id: Any, declared: MediaKind | None, origin: str, load: Callable[[], bytes],
                    verify: bool = False, loaded_id: Callable[[], Any] | None = None,
                    salt: str | None = None) -> MediaItem:
        """A source hashed before (SourceMemo) whose sniff answer is memoised too: a DeferredMediaItem,
        nothing decoded, read or hashed now (``verify``: its deferred load re-hashes the bytes).
        Otherwise the bytes are loaded, hashed and sniffed, and the source remembered -- under
        ``source_id`` only if ``loaded_id()`` (the id of what ``load`` actually read) is that id."""
        key = self.source_memo.get(source_id, salt)
        found = self.sniff_memo.get(key, salt) if key is not None else None
        if found is not None and (declared is None or declared in found.kinds):
            kind = declared or found.primary
            with self._counts_lock:
                self._counts[f"source_memo_hits.{kind.value}"] += 1
            deferred = (lambda: _same_content(load(), key, origin)) if verify else load
            return DeferredMediaItem(kind=kind, format=found.format, data=deferred, origin=origin, content_key=key)
        read_at = time.time()
        item = self._to_item(load(), declared, origin, salt=salt)
        if loaded_id is None or loaded_id() == source_id:
            self.source_memo.put(source_id, item.content_key, read_at, salt)
        return item

    def _file_item(self, raw: str, declared: MediaKind | None, salt: str | None = None) -> MediaItem:
        """A local file; its memo id comes from a stat after the path checks (not a regular file:
        no id, and the read refuses it). The read opens that very path (not ``raw`` resolved
        again: a symlink flipped in between would read another file) and the memo learns the
        content only under the id of the file it read, taken after reading: a file replaced or
        rewritten between the stat and the read never leaves its content under the old id."""
        real = self._allowed_path(raw)
        try:
            st = os.stat(real)
        except OSError:
            st = None
        source_id = file_id(str(real), st) if st is not None and stat.S_ISREG(st.st_mode) else None
        read: list[Any] = []

        def load() -> bytes:
            data, after = self._read_file(real, raw)
            read.append(file_id(str(real), after))
            return data
        return self._remembered(source_id, declared, "file", load, verify=True, loaded_id=lambda: read[-1],
                                salt=salt)

    def _check_size(self, nbytes: int) -> None:
        _check_bytes(nbytes, self.config.limits.max_bytes)

    def _parse_data_url(self, url: str) -> bytes:
        #  data:[<mediatype>][;base64],<payload>   — the media type is ignored: we sniff.
        # One copy of the text (the payload's slice; ``url[5:].partition`` made two): a copy of
        # megabytes is fresh memory, and on the 2-core host its page faults cost more than the copy
        comma = url.find(",", 5)
        if comma < 0:
            raise InvalidMediaError("data URL has no ',' before its payload")
        if url[max(5, comma - 7):comma].lower() == ";base64":
            return self._decode_base64(url[comma + 1:])
        self._check_size((len(url) - comma - 1) // 3)
        return urllib.parse.unquote_to_bytes(url[comma + 1:])

    def _decode_base64(self, payload: str, what: str = "data URL payload") -> bytes:
        # before decoding a huge payload: what it decodes to at most. Line breaks (base64 wrapped at 76
        # columns is ~2.6 % longer) decode to nothing, so they are counted out -- only when the payload
        # would otherwise be refused, where the counting (a pass per character) costs nothing that matters
        most = len(payload) * 3 // 4 - 2
        if most > self.config.limits.max_bytes:
            most = (len(payload) - sum(payload.count(c) for c in " \t\n\r\v\f")) * 3 // 4 - 2
        self._check_size(most)
        return _strict_base64(payload, what)

    def _allowed_path(self, raw: str) -> Path:
        """The real path of ``raw`` when it lies inside an allowed directory."""
        if not self._roots:
            raise MediaAccessDenied("local file access is disabled (no allowed_local_dirs)")
        if "\x00" in raw:
            raise InvalidMediaError("local media path contains a NUL character")
        path = Path(raw)
        if not path.is_absolute():
            raise InvalidMediaError(f"local media path must be absolute, got {raw!r}")
        real = path.resolve()  # follows symlinks and '..' so the check below sees the real target
        if not any(real.is_relative_to(root) for root in self._roots):
            raise MediaAccessDenied(f"path {raw!r} is outside the allowed media directories")
        return real

    def _read_file(self, real: Path, raw: str) -> tuple[bytes, os.stat_result]:
        """The bytes of ``real`` (``raw`` after the path checks) and its fstat once they are read."""
        return read_regular_file(real, self.config.limits.max_bytes, raw, nofollow=True)


def read_regular_file(path: str | Path, max_bytes: int | None, shown: str | None = None,
                      nofollow: bool = False) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``path`` (at most ``max_bytes``) and its fstat taken after
    reading; typed errors (``shown``: the path as the caller named it) before any byte is read.
    The one safe read of a local media file, for ingest and the caption job alike."""
    shown = str(path) if shown is None else shown
    # Regular files only, checked before open: opening a FIFO blocks until a writer comes (a
    # worker stuck for good, deaf to Ctrl-C) and a device never ends. O_NONBLOCK covers a swap
    # between the stat and the open; the fstat below re-checks what was opened.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (getattr(os, "O_NOFOLLOW", 0) if nofollow else 0)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise InvalidMediaError(f"media path {shown!r} is not a regular file")
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MediaNotFound(f"no such media file {shown!r}") from None
    except OSError as exc:
        raise MediaAccessDenied(f"cannot open media file {shown!r} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidMediaError(f"media path {shown!r} is not a regular file")
        _check_bytes(st.st_size, max_bytes)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)  # it may grow after fstat
        after = os.fstat(fd)
    finally:
        os.close(fd)
    _check_bytes(len(data), max_bytes)
    return data, after


def _check_bytes(nbytes: int, max_bytes: int | None) -> None:
    if max_bytes is not None and nbytes > max_bytes:
        raise MediaTooLarge(f"media is {nbytes} bytes, limit {max_bytes}")


def _same_content(data: bytes, key: str, origin: str) -> bytes:
    """``data`` when it hashes to ``key``: a remembered file read later must still hold that content."""
    if content_key(data) != key:
        raise InvalidMediaError(f"the {origin} changed while it was being served; send the request again")
    return data


def _strict_base64(payload: str, what: str = "data URL payload") -> bytes:
    """Standard base64 with whitespace allowed (line-wrapped payloads), anything else refused.

    The usual payload (canonical: no whitespace, padding only at the end) goes through pybase64's
    SIMD decoder, which validates as it decodes: 0.36 ms for the 8.7 MB payload of a 48 s 720p
    clip where CPython's ``a2b_base64`` takes 19 ms (~450 MB/s), with the GIL held, on the path
    before the video's first frame decodes. It accepts a subset of what the strict decode below
    accepts, with the same bytes (hypothesis-tested); what it refuses (whitespace, excess padding,
    garbage) takes the strict path, which decides and names the error. There
    ``a2b_base64(strict_mode=True)`` validates in C as it decodes, a piece at a time; the copy
    without whitespace is made only when the payload has some."""
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        return _a2b_pieces(payload)
    except (binascii.Error, ValueError) as first:
        if not payload.isascii():  # str.split() below would also drop Unicode spaces (U+0085, U+00A0, ...)
            raise InvalidMediaError(f"{what} is not valid base64 (a character outside ASCII)") from first
        stripped = "".join(payload.split())
        if len(stripped) == len(payload):
            raise InvalidMediaError(f"{what} is not valid base64 ({first})") from first
    try:
        return _a2b_pieces(stripped)
    except (binascii.Error, ValueError) as exc:
        raise InvalidMediaError(f"{what} is not valid base64 ({exc})") from exc


B64_PIECE = 1 << 20  # characters decoded per call (a multiple of 4)


def _a2b_pieces(text: str, piece: int = B64_PIECE) -> bytes:
    """``a2b_base64(text, strict_mode=True)`` a piece at a time. One call holds the GIL throughout:
    ~150 ms for the 100 MB payload of a 75 MB video, which every other thread -- the event loop's
    -- waited out; between pieces the interpreter hands the GIL to a thread that asked for it, so
    the longest hold is the final join (~30 ms at 100 MB). Strict mode sees one piece at a time,
    so padding anywhere but in the last piece is refused here, as the whole-text call refuses it."""
    if len(text) <= piece:
        return binascii.a2b_base64(text, strict_mode=True)
    starts = list(range(0, len(text), piece))
    data_end = len(text) - _trailing_padding(text)
    while len(starts) > 1 and starts[-1] >= data_end:
        # pieces of bare padding at the end: alone, strict mode refuses them as leading padding,
        # while the whole text takes them as excess after complete groups ("AAAAAAAA=" is 6
        # bytes): they go with the last piece that holds data
        starts.pop()
    parts = []
    for start, end in zip(starts, [*starts[1:], len(text)]):
        chars = text[start:end]
        if end < len(text) and "=" in chars:  # not the last piece
            raise binascii.Error("padding before the end of the data")
        parts.append(binascii.a2b_base64(chars, strict_mode=True))
    return b"".join(parts)


def _trailing_padding(text: str) -> int:
    """How many "=" end ``text``, looking at growing tails (``text.rstrip`` would copy it whole)."""
    k = 64
    while True:
        tail = text[-k:]
        data = tail.rstrip("=")
        if data or k >= len(text):
            return len(tail) - len(data)
        k *= 4


def _scheme(url: str) -> str:
    # looked for in the first 64 characters only: splitting a data URL copied its megabytes, twice a
    # request (0.13 ms each for a 12 s clip, seen in a profile of a repeated request); no scheme
    # is that long
    end = url.find(":", 0, 64)
    return url[:end].lower() if end >= 0 else ""
