"""mm_pipeline ingest: content sniffing, sources (bytes, data URL, allowed paths, loopback http),
limits and error statuses."""

from __future__ import annotations

import asyncio
import base64
import http.server
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.media_samples import animated_bytes, audio_bytes, image_bytes, video_bytes

from mm_pipeline.errors import (
    InvalidMediaError,
    MediaAccessDenied,
    MediaError,
    MediaFetchError,
    MediaFetchTimeout,
    MediaNotFound,
    MediaTooLarge,
    UnsupportedMediaType,
)
from mm_pipeline.media.content_hash import content_key
from mm_pipeline.media.ingest import MediaIngestor
from mm_pipeline.media.ingest_config import IngestConfig, MediaLimits
from mm_pipeline.media.types import MediaKind, MediaSource
from mm_pipeline.media.sniff import sniff
from mm_pipeline.media.worker_pool import WorkerPool
from mm_pipeline.server.errors import http_answer

IMAGE, VIDEO, AUDIO = MediaKind.IMAGE, MediaKind.VIDEO, MediaKind.AUDIO
PNG = image_bytes("PNG")

SAMPLES = {
    "png": (lambda: image_bytes("PNG"), "png", IMAGE, {IMAGE}),
    "jpeg": (lambda: image_bytes("JPEG"), "jpeg", IMAGE, {IMAGE}),
    "webp": (lambda: image_bytes("WEBP"), "webp", IMAGE, {IMAGE, VIDEO}),
    "gif": (lambda: animated_bytes("GIF"), "gif", IMAGE, {IMAGE, VIDEO}),
    "wav": (lambda: audio_bytes("wav", "pcm_s16le"), "wav", AUDIO, {AUDIO}),
    "flac": (lambda: audio_bytes("flac", "flac"), "flac", AUDIO, {AUDIO}),
    "mp3": (lambda: audio_bytes("mp3", "libmp3lame"), "mp3", AUDIO, {AUDIO}),
    "ogg": (lambda: audio_bytes("ogg", "libopus", rate=48000), "ogg", AUDIO, {AUDIO}),
    "m4a": (lambda: audio_bytes("mp4", "aac", rate=16000), "mp4", AUDIO, {AUDIO}),
    "mp4": (lambda: video_bytes("mp4", "mpeg4"), "mp4", VIDEO, {VIDEO}),
    "mp4+audio": (lambda: video_bytes("mp4", "mpeg4", with_audio=True), "mp4", VIDEO, {VIDEO, AUDIO}),
    "webm": (lambda: video_bytes("webm", "libvpx"), "webm", VIDEO, {VIDEO}),
}


# ---- sniffing -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sniff_detects_type_from_content(name: str) -> None:
    make, fmt, primary, kinds = SAMPLES[name]
    found = sniff(make())
    assert (found.format, found.primary, set(found.kinds)) == (fmt, primary, kinds)


@pytest.mark.parametrize("garbage", [b"hello world " * 50, os.urandom(4096), b"\x00" * 100,
                                     b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n"])
def test_sniff_garbage_is_415(garbage: bytes) -> None:
    with pytest.raises(UnsupportedMediaType) as info:
        sniff(garbage)
    assert http_answer(type(info.value)).status == 415


def test_empty_payload_is_400() -> None:
    with pytest.raises(InvalidMediaError) as info:
        MediaIngestor(IngestConfig()).ingest_local(MediaSource(data=b""))
    assert http_answer(type(info.value)).status == 400


def test_name_and_declared_mime_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "cat.mp4").write_bytes(PNG)  # a PNG named .mp4
    ing = MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),)))
    assert ing.ingest_local(MediaSource(path=str(tmp_path / "cat.mp4"))).format == "png"
    url = "data:video/mp4;base64," + base64.b64encode(PNG).decode()
    assert ing.ingest_local(MediaSource(url=url)).format == "png"


def test_declared_kind_must_fit_content() -> None:
    ing = MediaIngestor(IngestConfig())
    assert ing.ingest_local(MediaSource(data=animated_bytes("GIF"), kind=VIDEO)).kind is VIDEO
    assert ing.ingest_local(MediaSource(data=SAMPLES["mp4+audio"][0](), kind=AUDIO)).kind is AUDIO
    with pytest.raises(UnsupportedMediaType, match="not usable as audio"):
        ing.ingest_local(MediaSource(data=PNG, kind=AUDIO))


def test_hash_first_a_repeated_container_is_not_opened_again(tmp_path: Path, monkeypatch) -> None:
    """The content key is computed before the sniff; a key seen before answers the sniff, so PyAV
    never opens the container again (every source that holds bytes: upload, data URL, file)."""
    import av

    mp4 = SAMPLES["mp4"][0]()
    (tmp_path / "clip.bin").write_bytes(mp4)
    ing = MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),)))
    first = ing.ingest_local(MediaSource(data=mp4))
    assert first.content_key == content_key(mp4) and first.kind is VIDEO
    assert ing.counts == {"content_hashes.video": 1, "sniff_probes.video": 1}
    opens = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: opens.append(1) or real_open(*a, **k))
    again = [ing.ingest_local(MediaSource(url="data:;base64," + base64.b64encode(mp4).decode())),
             ing.ingest_local(MediaSource(path=str(tmp_path / "clip.bin"))),
             ing.ingest_local(MediaSource(data=mp4, kind=VIDEO))]
    assert opens == [] and {(i.format, i.kind, i.content_key) for i in again} == {("mp4", VIDEO, first.content_key)}
    assert ing.counts["sniff_memo_hits.video"] == 3 and ing.counts["sniff_probes.video"] == 1
    # the memo answers kinds too: a declared kind the content cannot serve is still refused
    with pytest.raises(UnsupportedMediaType, match="not usable as audio"):
        ing.ingest_local(MediaSource(data=mp4, kind=AUDIO))
    # magic-byte formats need no open at all; an image counts as hashed, never as probed
    ing.ingest_local(MediaSource(data=PNG))
    assert ing.counts["content_hashes.image"] == 1 and "sniff_probes.image" not in ing.counts
    # failures are not remembered: garbage is refused every time, the memo stays bounded
    for _ in range(2):
        with pytest.raises(UnsupportedMediaType):
            ing.ingest_local(MediaSource(data=b"\x00garbage" * 8))
    assert len(ing.sniff_memo) == 2


# ---- sources --------------------------------------------------------------------------------

def test_data_url_base64_and_percent_encoded() -> None:
    ing = MediaIngestor(IngestConfig())
    b64 = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert ing.ingest_local(MediaSource(url=b64)).data == PNG
    pct = "data:," + "".join(f"%{b:02x}" for b in PNG)
    assert ing.ingest_local(MediaSource(url=pct)).data == PNG
    with pytest.raises(InvalidMediaError, match="base64"):
        ing.ingest_local(MediaSource(url="data:image/png;base64,@@@"))
    # line-wrapped payloads decode; characters outside the alphabet, misplaced padding and data
    # after the padding are refused, with or without whitespace around them
    text = base64.b64encode(PNG).decode()
    wrapped = "data:;base64," + "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76)) + "\n"
    assert MediaIngestor(IngestConfig()).ingest_local(MediaSource(url=wrapped)).data == PNG
    for bad in (text[:8] + "*" + text[8:], text[:8] + " *" + text[8:], "QQ==QQ==", "QQ=\n=QQ", text[:-1] + "!"):
        with pytest.raises(InvalidMediaError, match="not valid base64"):
            MediaIngestor(IngestConfig()).ingest_local(MediaSource(url="data:;base64," + bad))
    with pytest.raises(InvalidMediaError, match="','"):
        ing.ingest_local(MediaSource(url="data:image/png;base64"))
    # the media type's ";base64" is case-blind and must end the head; a head too short for it is plain
    assert ing.ingest_local(MediaSource(url="data:image/png;BASE64," + text)).data == PNG
    assert ing.ingest_local(MediaSource(url="data:x," + "".join(f"%{b:02x}" for b in PNG))).data == PNG
    with pytest.raises(UnsupportedMediaType):  # ";base64" not at the end: the payload is read as plain text
        ing.ingest_local(MediaSource(url="data:;base64;x=1," + text))
    with pytest.raises(InvalidMediaError, match="scheme"):
        ing.ingest_local(MediaSource(url="ftp://x/y.png"))
    assert ing.ingest_local(MediaSource(url="DATA" + b64[4:])).data == PNG  # schemes are case-blind
    # the scheme is read from the first 64 characters (a data URL is never split whole): a colon
    # further in is no scheme
    with pytest.raises(InvalidMediaError, match="scheme ''"):
        ing.ingest_local(MediaSource(url="x" * 100 + ":" + b64))


def test_path_allow_list(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (outside / "b.png").write_bytes(PNG)
    (allowed / "escape.png").symlink_to(outside / "b.png")  # symlink pointing out
    (allowed / "inner.png").symlink_to(allowed / "a.png")  # symlink staying in
    ing = MediaIngestor(IngestConfig(allowed_local_dirs=(str(allowed),)))
    assert ing.ingest_local(MediaSource(path=str(allowed / "a.png"))).data == PNG
    assert ing.ingest_local(MediaSource(path=str(allowed / "inner.png"))).data == PNG
    assert ing.ingest_local(MediaSource(url=(allowed / "a.png").as_uri())).data == PNG
    for bad in [outside / "b.png", allowed / "escape.png", allowed / ".." / "secret" / "b.png",
                Path("/etc/passwd")]:
        with pytest.raises(MediaAccessDenied) as info:
            ing.ingest_local(MediaSource(path=str(bad)))
        assert http_answer(type(info.value)).status == 403
    with pytest.raises(MediaNotFound):
        ing.ingest_local(MediaSource(path=str(allowed / "missing.png")))
    with pytest.raises(InvalidMediaError, match="regular file"):
        ing.ingest_local(MediaSource(path=str(allowed)))
    with pytest.raises(InvalidMediaError, match="absolute"):
        ing.ingest_local(MediaSource(path="media/a.png"))
    with pytest.raises(MediaAccessDenied, match="disabled"):
        MediaIngestor(IngestConfig()).ingest_local(MediaSource(path=str(allowed / "a.png")))


def test_byte_limit_on_every_source(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(PNG)
    cfg = IngestConfig(allowed_local_dirs=(str(tmp_path),), limits=MediaLimits(max_bytes=len(PNG) - 1))
    ing = MediaIngestor(cfg)
    for source in [MediaSource(data=PNG), MediaSource(path=str(tmp_path / "a.png")),
                   MediaSource(url="data:;base64," + base64.b64encode(PNG).decode())]:
        with pytest.raises(MediaTooLarge) as info:
            ing.ingest_local(source)
        assert http_answer(type(info.value)).status == 413


def test_line_breaks_do_not_count_against_the_byte_limit() -> None:
    """A line-wrapped base64 payload whose bytes fit the limit is taken (its line breaks decode to
    nothing); one byte more is still refused, wrapped or not."""
    data = os.urandom(30_000)
    text = base64.b64encode(data).decode()
    wrapped = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    assert len(wrapped) * 3 // 4 > len(data) + 500  # the length alone would refuse it
    fits = MediaIngestor(IngestConfig(limits=MediaLimits(max_bytes=len(data))))
    assert fits._decode_base64(wrapped) == data
    tight = MediaIngestor(IngestConfig(limits=MediaLimits(max_bytes=len(data) - 1)))
    for payload in (text, wrapped):
        with pytest.raises(MediaTooLarge):
            tight.ingest_local(MediaSource(url="data:;base64," + payload))


def test_media_source_needs_exactly_one_reference() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        MediaSource(data=PNG, url="data:,x")
    with pytest.raises(ValueError, match="exactly one"):
        MediaSource()


# ---- remote (loopback server only) ----------------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        port = self.server.server_address[1]
        routes = {
            "/img.png": lambda: self._send(PNG),
            "/same-host-redirect": lambda: self._redirect("/img.png"),
            "/other-host-redirect": lambda: self._redirect(f"http://localhost:{port}/img.png"),
            "/file-redirect": lambda: self._redirect("file:///etc/passwd"),
            "/loop": lambda: self._redirect("/loop"),
            "/big": lambda: self._send(b"\x89PNG\r\n\x1a\n" + bytes(5000)),
            "/big-chunked": lambda: self._send(b"\x89PNG\r\n\x1a\n" + bytes(5000), length=False),
            "/slow": lambda: (time.sleep(1.5), self._send(PNG)),
        }
        routes.get(self.path, lambda: self._send(b"nope", status=404))()

    def _send(self, body: bytes, status: int = 200, length: bool = True) -> None:
        self.send_response(status)
        if length:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _remote(**overrides: object) -> MediaIngestor:
    cfg = dict(allow_remote=True, allowed_domains=("127.0.0.1",), fetch_timeout_s=5.0, allow_private_hosts=True,
               limits=MediaLimits(max_bytes=4096))
    cfg.update(overrides)
    return MediaIngestor(IngestConfig(**cfg), pool=WorkerPool(1, 4))  # type: ignore[arg-type]


def _ingest(ing: MediaIngestor, url: str) -> object:
    return asyncio.run(ing.ingest(MediaSource(url=url, kind=IMAGE)))


def test_remote_fetch_allowed_host_and_same_host_redirect(http_base: str) -> None:
    ing = _remote()
    for path in ["/img.png", "/same-host-redirect"]:
        item = _ingest(ing, http_base + path)
        assert item.data == PNG and item.format == "png"  # type: ignore[attr-defined]
        # hashed while the chunks arrived: the same key as hashing the whole body afterwards
        assert item.content_key == content_key(PNG)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("path", "error", "status"), [
    ("/other-host-redirect", MediaAccessDenied, 403),  # localhost is not on the allow-list
    ("/file-redirect", MediaAccessDenied, 403),
    ("/loop", MediaFetchError, 400),
    ("/big", MediaTooLarge, 413),  # Content-Length says too big
    ("/big-chunked", MediaTooLarge, 413),  # no length: cut off while streaming
    ("/missing", MediaFetchError, 400),
])
def test_remote_fetch_refusals(http_base: str, path: str, error: type[MediaError], status: int) -> None:
    with pytest.raises(error) as info:
        _ingest(_remote(), http_base + path)
    assert http_answer(type(info.value)).status == status


def test_fetch_failures_are_told_in_words_not_library_class_names(http_base: str) -> None:
    """A refused connection and a redirect loop say what happened; httpx's exception class names
    (ConnectError, TooManyRedirects) stay in the log."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    for url, words in ((f"http://127.0.0.1:{closed}/x.png", "could not connect"), (http_base + "/loop", "redirects")):
        with pytest.raises(MediaFetchError) as info:
            _ingest(_remote(), url)
        assert words in str(info.value) and "Error" not in str(info.value) and "Too" not in str(info.value)


def test_remote_fetch_off_by_default_and_domain_list(http_base: str) -> None:
    with pytest.raises(MediaAccessDenied, match="disabled"):
        _ingest(MediaIngestor(IngestConfig()), http_base + "/img.png")
    with pytest.raises(MediaAccessDenied, match="allow-list"):
        _ingest(_remote(allowed_domains=("example.com",)), http_base + "/img.png")


def test_remote_fetch_timeout(http_base: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(MediaFetchTimeout) as info:
        _ingest(_remote(fetch_timeout_s=0.3), http_base + "/slow")
    assert http_answer(type(info.value)).status == 408
    assert time.perf_counter() - t0 < 1.2


def test_an_allowed_host_resolving_to_a_private_address_is_refused(http_base: str) -> None:
    """The allow-list names hosts; where they resolve is checked too (localhost, metadata IPs)."""
    for domains, url in [(("127.0.0.1",), http_base + "/img.png"),
                         (("localhost",), http_base.replace("127.0.0.1", "localhost") + "/img.png"),
                         (("169.254.169.254",), "http://169.254.169.254/latest/meta-data/")]:
        with pytest.raises(MediaAccessDenied, match="non-public address") as info:
            _ingest(_remote(allowed_domains=domains, allow_private_hosts=False), url)
        assert http_answer(type(info.value)).status == 403


def test_a_nul_in_a_file_url_is_invalid_media(tmp_path: Path) -> None:
    ing = MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),)))
    for source in [MediaSource(url=f"file://{tmp_path}/a%00.png"), MediaSource(path=f"{tmp_path}/a\x00.png")]:
        with pytest.raises(InvalidMediaError, match="NUL") as info:
            ing.ingest_local(source)
        assert http_answer(type(info.value)).status == 400


def test_the_connection_goes_to_the_address_that_was_checked() -> None:
    """DNS rebinding: a resolver answering a public address to a check and 127.0.0.1 to the
    connection. The check is made by the connection itself, once per connection, and the socket is
    opened to exactly the checked address; a non-public answer never reaches a socket."""
    import httpcore

    from mm_pipeline.media.remote.public_hosts import PublicHostsTransport

    answers = iter([["93.184.216.34"], ["127.0.0.1"], ["93.184.216.34", "::ffff:10.0.0.1"]])
    resolved, connected = [], []

    async def rebinding(host: str, port: int) -> list[str]:
        resolved.append(host)
        return next(answers)

    class Recorder(httpcore.AsyncNetworkBackend):
        async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            connected.append((host, port))
            raise httpcore.ConnectError("no network in tests")

        async def sleep(self, seconds):
            await asyncio.sleep(seconds)

    def fetch() -> None:
        ing = MediaIngestor(IngestConfig(allow_remote=True, allowed_domains=("media.example",)),
                            transport=PublicHostsTransport(rebinding, Recorder()))
        asyncio.run(ing.ingest(MediaSource(url="http://media.example/a.png", kind=IMAGE)))

    with pytest.raises(MediaFetchError, match="failed"):  # public: the socket goes to that address
        fetch()
    assert connected == [("93.184.216.34", 80)] and resolved == ["media.example"]
    for _ in range(2):  # private alone, or among public ones: refused before any socket
        with pytest.raises(MediaAccessDenied, match="non-public address"):
            fetch()
    assert connected == [("93.184.216.34", 80)] and len(resolved) == 3
