"""Fetching an http(s) media body: the remote half of ingest (``media.ingest``).

The body arrives into one growing buffer (``ArrivingBytes``) that the content hash and, for a
streamable video or an audio item, an early decoder (``media.decode.early``) read while it grows;
the size cap applies chunk by chunk. An MP4 whose index follows its samples has the index fetched
from its end first (``media.index_from_end``).

Security rules:
  * remote fetch off by default; when on, only http(s) to hosts on ``allowed_domains`` (exact host or
    a subdomain), every redirect hop re-checked, a total deadline and a streamed size cap;
  * the body is asked for and read unencoded (``Accept-Encoding: identity``, raw bytes): a
    response with a Content-Encoding is refused (``_check_encoding``), so the size cap counts the
    very bytes that arrive and no decompressor runs on the event loop;
  * an allowed host must also resolve to public addresses only (no loopback, private, link-local
    or reserved range: a DNS name on the list pointed at 127.0.0.1 or 169.254.169.254 is refused)
    unless ``allow_private_hosts``; the check is made by the connection itself, which connects to
    the very addresses it checked (``media.remote.public_hosts``: no DNS-rebinding window).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any, Callable

import httpx

from mm_pipeline.errors import (InvalidMediaError, MediaAccessDenied, MediaFetchError, MediaFetchTimeout, MediaTooLarge,
                                echo)
from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.index_from_end import IndexFromEnd, fetch_range
from mm_pipeline.media.ingest_config import IngestConfig
from mm_pipeline.media.remote.public_hosts import PublicHostsTransport
from mm_pipeline.media.sniff import layout_and_need
from mm_pipeline.media.types import MediaKind

log = logging.getLogger(__name__)

_FIRST_LOOK = 1 << 16  # the bytes the layout is first looked for in (most files tell from their first 100)

# (body, layout, declared kind, origin) -> a started early decode, or None (media.decode.early)
EarlyDecode = Callable[[ArrivingBytes, str, MediaKind | None, str], Any]


class RemoteFetch:
    """Fetches http(s) bodies under one ``IngestConfig``; ``count`` is told each early start from a
    fetched index (``index_from_end``) and each index that was not the body's end."""

    def __init__(self, config: IngestConfig, count: Callable[[str], None],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self._count = count
        self._transport = transport

    async def fetch(self, url: str, kind: MediaKind | None = None,
                    early_decode: EarlyDecode | None = None) -> tuple[bytes, str, Any]:
        """The body, its content key (hashed chunk by chunk as it arrives, no second pass) and the
        early decode ``early_decode`` started on it while it arrived (or None)."""
        if not self.config.allow_remote:
            raise MediaAccessDenied("remote media URLs are disabled on this server")
        # the early decode once started: the body can be complete and the decode running when a
        # cancel or the deadline lands on the awaits after it (closing the response, the client),
        # and then nobody else would ever stop it or give back what it holds of the decode budget
        started: list[Any] = []
        try:
            return await asyncio.wait_for(self._follow(url, kind, early_decode, started), self.config.fetch_timeout_s)
        except BaseException as exc:
            for early in started:
                early.cancel()
            if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException)):
                raise MediaFetchTimeout(
                    f"fetching {short_url(url)} took longer than {self.config.fetch_timeout_s} s") from None
            if isinstance(exc, httpx.HTTPError):  # the library's class name stays in the log
                log.info("fetching %s failed: %s: %s", short_url(url), type(exc).__name__, exc)
                raise MediaFetchError(f"fetching {short_url(url)} failed: {_why(exc)}") from None
            if isinstance(exc, (httpx.InvalidURL, OverflowError)):  # one httpx cannot connect to
                raise InvalidMediaError(f"media URL {short_url(url)} is not a valid http(s) URL ({exc})") from None
            raise

    async def _follow(self, url: str, kind: MediaKind | None, early_decode: EarlyDecode | None,
                      started: list[Any]) -> tuple[bytes, str, Any]:
        limit = self.config.limits.max_bytes
        transport = self._transport
        if transport is None and not self.config.allow_private_hosts:
            transport = PublicHostsTransport()  # every connection (redirect hops too) checks its addresses
        async with httpx.AsyncClient(follow_redirects=False, transport=transport,
                                     timeout=self.config.fetch_timeout_s, trust_env=False) as client:
            for _ in range(self.config.max_redirects + 1):
                self._check_host(url)
                async with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
                    if response.is_redirect:
                        location = response.headers.get("location", "")
                        try:
                            url = urllib.parse.urljoin(url, location)
                        except ValueError:
                            raise MediaFetchError(f"{short_url(url)} redirects to an invalid URL") from None
                        continue
                    if response.status_code >= 400:
                        raise MediaFetchError(f"{short_url(url)} answered HTTP {response.status_code}")
                    _check_encoding(response, url)
                    declared = response.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > limit:
                        raise MediaTooLarge(f"{short_url(url)} is {declared} bytes, limit {limit}")
                    size = int(declared) if declared is not None and declared.isdigit() else None
                    # a host that says it has no ranges is not asked for the end (one that does
                    # not say may still have them: asked, as a browser does)
                    ranges = response.headers.get("accept-ranges", "").strip().lower() != "none"
                    return await self._receive(response.aiter_raw(), url, kind, early_decode, size,
                                               functools.partial(fetch_range, client, url) if ranges else None,
                                               started)
        raise MediaFetchError(f"more than {self.config.max_redirects} redirects fetching media")

    async def _receive(self, chunks: AsyncIterator[bytes], url: str, kind: MediaKind | None,
                       early_decode: EarlyDecode | None, declared_size: int | None,
                       fetch_tail: Callable[[int, int], Any] | None, started: list[Any]) -> tuple[bytes, str, Any]:
        """Hash the chunks as they arrive into one growing buffer; a streamable video or an audio
        item starts decoding from that buffer as soon as its layout is known, an MP4 with its index
        at the end once ``fetch_tail`` (None: the host has no ranges) has fetched it
        (media.index_from_end). Any failure (size cap, deadline, disconnect, cancel) fails the
        buffer, which stops the decoder at its next read."""
        body = ArrivingBytes(self.config.limits.max_bytes, stall_s=self.config.fetch_timeout_s,
                             declared_size=declared_size)
        early, layout, tail = None, None, None
        need = 0  # the first bytes the layout can be told from (sniff.layout_and_need)
        wants_early = (early_decode is not None and self.config.decode_while_receiving
                       and kind in (None, MediaKind.VIDEO, MediaKind.AUDIO))
        try:
            async for chunk in chunks:
                try:
                    body.feed(chunk)
                except MediaTooLarge:
                    raise MediaTooLarge(f"{short_url(url)} is over the {body.max_bytes}-byte limit") from None
                while wants_early and layout is None and body.received >= need:
                    head = body.head(max(need, _FIRST_LOOK))
                    layout, need = layout_and_need(head)  # need > len(head) while it cannot tell
                    if layout:
                        early = early_decode(body, layout, kind, short_url(url))  # type: ignore[misc]
                        if early is not None:
                            started.append(early)
                    elif layout == "" and fetch_tail is not None and self.config.fetch_index_from_end:
                        tail = IndexFromEnd.start(body, head, fetch_tail)
                if tail is not None and early is None and tail.ready():
                    early = early_decode(body, "index", kind, short_url(url))  # type: ignore[misc]
                    if early is not None:
                        started.append(early)
                        self._count("index_from_end")
            data, key = body.finish()
            if body.tail_mismatch and early is not None:
                early.cancel()  # the index fetched was not this body's: nothing it decoded is used
                early = None
                self._count("index_from_end_mismatches")
            return data, key, early
        except BaseException:
            body.fail()  # (fetch cancels every early decode started here)
            raise
        finally:
            if tail is not None:
                await tail.close()

    def _check_host(self, url: str) -> None:
        try:  # what urllib and httpx both refuse: a bad IPv6 literal or port, control characters
            parts = urllib.parse.urlsplit(url)
            parts.port
            httpx.URL(url)
        except (ValueError, httpx.InvalidURL) as exc:
            raise InvalidMediaError(f"media URL {short_url(url)} is not a valid http(s) URL ({exc})") from None
        if parts.scheme not in ("http", "https"):
            raise MediaAccessDenied(f"redirect to a {parts.scheme!r} URL is not allowed")
        host = (parts.hostname or "").lower().rstrip(".")
        allowed = any(host == d or host.endswith("." + d)
                      for d in (d.lower().strip(".") for d in self.config.allowed_domains))
        if not allowed:
            raise MediaAccessDenied(f"host {host!r} is not on the media domain allow-list")


def _check_encoding(response: httpx.Response, url: str) -> None:
    """Refuse a body sent with a content encoding although none was accepted.

    httpx would decode it chunk by chunk with no bound on what one chunk becomes: a body of
    ``Content-Encoding: gzip, gzip`` a few KiB long inflates to hundreds of MiB in one bytes
    object, on the event loop, before the size cap sees it. Decoding one gzip layer ourselves
    with a bounded ``decompressobj`` was the alternative; refused instead, because media formats
    are compressed already (gzip gains a server nothing), a server that honours
    ``Accept-Encoding: identity`` never sends one, and no decompression then runs on the loop."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MediaFetchError(f"{short_url(url)} sent its body with Content-Encoding {echo(encoding)}; media is "
                              f"fetched unencoded (Accept-Encoding: identity)")


def short_url(url: str) -> str:
    """A URL for messages: never the payload of a data URL, never a query string."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # one urllib cannot split (a bad IPv6 literal): cut at its query
        return url.split("?", 1)[0][:200]
    return f"{parts.scheme}://{parts.netloc}{parts.path}"[:200]


def _why(exc: httpx.HTTPError) -> str:
    """What went wrong in words a client can act on, not httpx's class names (README, Limits)."""
    if isinstance(exc, httpx.ConnectError):
        return "could not connect to the host"
    if isinstance(exc, httpx.TooManyRedirects):
        return "too many redirects"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "the server closed the connection or broke the HTTP protocol"
    if isinstance(exc, (httpx.NetworkError, httpx.ProxyError)):
        return "the connection failed"
    return "the request failed"
