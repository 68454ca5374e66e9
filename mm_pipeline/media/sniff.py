"""Media type detection from content (magic bytes first, a PyAV probe as fallback) — never from a
file name, URL suffix or declared MIME type, which clients get wrong or forge.

Containers that can hold either audio or video (MP4, Matroska/WebM, Ogg, AVI...) are probed for
their streams, opened as every media stage opens bytes with PyAV (``av_container.open_av``: no
nested protocol opens, no frame over the pixel limit decoded by FFmpeg's stream probe).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import av

from mm_pipeline.errors import InvalidMediaError, UnsupportedMediaType
from mm_pipeline.media import av_container
from mm_pipeline.media.av_container import DEFAULT_MAX_PIXELS, open_av, oversized_video, sizeless_video, video_stream
from mm_pipeline.media.types import MediaKind

IMAGE, VIDEO, AUDIO = MediaKind.IMAGE, MediaKind.VIDEO, MediaKind.AUDIO
open_av_stream = av_container.open_av_stream  # (the audio decoders import both openers from here)

# FFmpeg demuxers we accept after a probe.  Everything else (image2 pipes, tty, playlists, concat
# lists, raw elementary streams without timestamps) is refused with 415.
_PROBE_FORMATS = {
    "mov,mp4,m4a,3gp,3g2,mj2": "mp4",
    "matroska,webm": "matroska",
    "ogg": "ogg",
    "avi": "avi",
    "mpegts": "mpegts",
    "mpeg": "mpeg",
    "flv": "flv",
    "asf": "asf",
    "mp3": "mp3",
    "aac": "aac",
    "wav": "wav",
    "w64": "w64",
    "flac": "flac",
    "aiff": "aiff",
    "au": "au",
    "caf": "caf",
    "amr": "amr",
    "ac3": "ac3",
    "eac3": "eac3",
}
_HEAD_LIMIT = 1 << 20  # top-level MP4 boxes before moov/mdat past this: not worth streaming
# Top-level MP4 boxes walked before an answer, at most. Real files have a handful before their
# moov / mdat / moof (ftyp, free, wide, uuid, sidx); a file of 8-byte boxes would otherwise make
# each look at an arriving body a walk of up to 131k boxes on the event loop (~85 ms), again with
# every chunk. Past it: not streamed early, decoded after arrival.
_MAX_LEADING_BOXES = 64
# The largest MP4 index (moov) waited for to decode while the rest arrives, at the start of a file
# or fetched from its end (media.index_from_end). An hour of video at 30 fps with its sound has
# ~260k samples, 2-3 MB of sample tables; a 128 MiB limit allows such a low-bitrate lecture.
MAX_INDEX_BYTES = 16 << 20


@dataclass(frozen=True)
class SniffResult:
    """``format``: canonical container name.  ``kinds``: what the content can serve as (an MP4 with
    sound is a video and an audio; a GIF is an image, or a video of its frames).  ``primary``: the
    kind used when the request did not declare one.  ``probed``: the answer needed a PyAV open (a
    container), not just magic bytes."""

    format: str
    primary: MediaKind
    kinds: frozenset[MediaKind]
    probed: bool = False

    def __post_init__(self) -> None:
        if self.primary not in self.kinds:
            raise ValueError(f"SniffResult: primary {self.primary} not in kinds {set(self.kinds)}")


def streamable_layout(head: bytes) -> str | None:
    """How a container can be decoded front to back as it arrives, from its first bytes:
    ``"index"`` (MP4 with its whole sample table, ``moov``, before ``mdat``), ``"fragments"``
    (fragmented MP4), ``"matroska"`` (Matroska/WebM), ``"ogg"``, ``"audio"`` (WAV, FLAC, MP3,
    ADTS: a plain audio stream); ``""``: it cannot (``moov`` after ``mdat``, anything else); None:
    the bytes so far do not tell yet (``layout_and_need`` says how many will)."""
    return layout_and_need(head)[0]


def layout_and_need(head: bytes) -> tuple[str | None, int]:
    """``streamable_layout(head)`` and, where it is None, how many first bytes it needs to answer
    (more than ``len(head)``: the end of the box it stopped in; ``len(head)`` once answered). A
    caller with bytes still arriving looks again only then, so a long video's index of megabytes
    is read once when whole, not copied again with every chunk before it."""
    if len(head) < 12:
        return None, 12
    if _sniff_plain_audio(head[:16]) is not None:
        return "audio", len(head)
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML
        return "matroska", len(head)
    if head[:4] == b"OggS":
        return "ogg", len(head)
    if head[4:8] != b"ftyp":
        return "", len(head)
    pos = boxes = 0
    fragmented = False  # a moov with mvex was seen: answer at the first moof, so that whatever
    while pos + 8 <= len(head):  # precedes it (a sidx stating the duration) has arrived too
        if (boxes := boxes + 1) > _MAX_LEADING_BOXES:
            return "fragments" if fragmented else "", len(head)
        size, kind = int.from_bytes(head[pos:pos + 4], "big"), head[pos + 4:pos + 8]  # size (4) | type (4)
        if size == 1:  # a 64-bit size follows
            if pos + 16 > len(head):
                return None, pos + 16
            size = int.from_bytes(head[pos + 8:pos + 16], "big")
        if kind == b"moof":
            return "fragments", len(head)
        if kind == b"mdat" and not fragmented:
            return "", len(head)  # samples first, index at the end
        if kind == b"moov":
            if pos + size > len(head):  # wait for the whole index, up to a long video's
                return (None, pos + size) if pos + size <= MAX_INDEX_BYTES else ("", len(head))
            if head.find(b"mvex", pos, pos + size) < 0:  # (no slice: an index can be megabytes)
                return "index", len(head)
            fragmented = True  # the first fragment's samples (mdat) or a sidx may follow
        if size < 8:  # 0: the box runs to the end of the file
            return "fragments" if fragmented else "", len(head)
        pos += size
    if pos + 8 <= _HEAD_LIMIT:
        return None, pos + 8
    return "fragments" if fragmented else "", len(head)


def index_after_samples(head: bytes, size: int) -> int | None:
    """Where the rest of an MP4 that put its samples (``mdat``) before its index begins: the end of
    that first ``mdat``, from the first bytes of a ``size``-byte file; None when the file is not
    such an MP4 (``streamable_layout`` answers for the others), the ``mdat`` runs to the end of the
    file (size 0) or its header has not arrived yet. What lies after it -- the ``moov``, in what
    FFmpeg's default MP4 output and most cameras write -- can be fetched on its own (an HTTP range)
    and decoding then follows the samples as they arrive (media.index_from_end)."""
    if len(head) < 12 or head[4:8] != b"ftyp":
        return None
    pos = 0
    for _ in range(_MAX_LEADING_BOXES):
        if pos + 8 > len(head):
            return None
        box, kind = int.from_bytes(head[pos:pos + 4], "big"), head[pos + 4:pos + 8]
        if box == 1:
            if pos + 16 > len(head):
                return None
            box = int.from_bytes(head[pos + 8:pos + 16], "big")
        if box < 8 or kind in (b"moov", b"moof"):
            return None
        if kind == b"mdat":
            return pos + box if pos + box < size else None
        pos += box
    return None


def plain_audio_format(head: bytes) -> str | None:
    """``"wav"``, ``"flac"``, ``"mp3"`` or ``"aac"`` (ADTS) from the first bytes, else None."""
    found = _sniff_plain_audio(head[:16])
    return found.format if found is not None else None


def fragments_duration(head: bytes) -> float | None:
    """The whole duration (seconds) a fragmented MP4 states before its first ``moof``, or None:
    ``mehd`` (moov/mvex, in the ``mvhd`` timescale; packagers such as Bento4 and GPAC write it) or
    a leading ``sidx`` with at least two references (FFmpeg's ``global_sidx``, DASH on-demand: the
    earliest presentation time plus the subsegment durations of every fragment). FFmpeg's own
    fragmented output states neither by default
    (``frag_keyframe+empty_moov``: an empty sample table, no ``mehd``, ``trex`` default duration 0;
    without ``empty_moov`` the ``moov`` counts the first fragment only); a ``sidx`` of one
    reference may describe its fragment alone, so it is not taken for the whole."""
    timescale = 0
    for kind, start, end in _boxes(head, 0, len(head)):
        if kind == b"moof":
            return None
        if kind == b"moov":
            for inner, s, e in _boxes(head, start, end):
                if inner == b"mvhd" and e - s >= 24:
                    timescale = int.from_bytes(head[s + 20:s + 24] if head[s] else head[s + 12:s + 16], "big")
                elif inner == b"mvex":
                    for leaf, ls, le in _boxes(head, s, e):
                        if leaf == b"mehd" and le - ls >= 8 and timescale:
                            wide = head[ls] == 1
                            value = int.from_bytes(head[ls + 4:ls + (12 if wide else 8)], "big")
                            return value / timescale if value else None
        elif kind == b"sidx" and end - start >= 24:
            wide = head[start] == 1
            scale = int.from_bytes(head[start + 8:start + 12], "big")
            count_at = start + (28 if wide else 20) + 2
            count = int.from_bytes(head[count_at:count_at + 2], "big")
            refs = count_at + 2
            if count < 2 or not scale or refs + 12 * count > end:
                return None
            # the end of the last subsegment: its start (after samples the moov itself holds, when
            # it is not empty) plus every subsegment's duration
            start_time = int.from_bytes(head[start + 12:start + (20 if wide else 16)], "big")
            return (start_time + sum(int.from_bytes(head[r + 4:r + 8], "big")
                                     for r in range(refs, refs + 12 * count, 12))) / scale
    return None


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, box end) of the complete boxes in ``data[start:end]``, the first
    ``_MAX_LEADING_BOXES`` of them (a walk the sender cannot make long: it runs on the event loop)."""
    pos = start
    for _ in range(_MAX_LEADING_BOXES):
        if pos + 8 > end:
            return
        size, kind, header = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8], 8
        if size == 1 and pos + 16 <= end:
            size, header = int.from_bytes(data[pos + 8:pos + 16], "big"), 16
        if size < header or pos + size > end:
            return
        yield kind, pos + header, pos + size
        pos += size


def sniff(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> SniffResult:
    """Detect the media type of ``data``; ``max_pixels``: the pixel limit (``MediaLimits``) a
    container is opened with (``av_container.open_av``).

    Raises ``InvalidMediaError`` (400) for empty input, ``UnsupportedMediaType`` (415) when neither
    the magic bytes nor a probe find a supported image, audio or video."""
    if not data:
        raise InvalidMediaError("media payload is empty")
    head = data[:16]
    image = _sniff_image(head)
    if image is not None:
        return image
    audio = _sniff_plain_audio(head)
    if audio is not None:
        return audio
    return _probe(data, max_pixels)


def _sniff_image(head: bytes) -> SniffResult | None:
    still = frozenset({IMAGE})
    animated = frozenset({IMAGE, VIDEO})  # first frame as an image, all frames as a video
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return SniffResult("png", IMAGE, still)
    if head.startswith(b"\xff\xd8\xff"):
        return SniffResult("jpeg", IMAGE, still)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return SniffResult("gif", IMAGE, animated)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return SniffResult("webp", IMAGE, animated)
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return SniffResult("tiff", IMAGE, still)
    if head[:2] == b"BM" and len(head) >= 14 and head[6:10] == b"\x00\x00\x00\x00":
        return SniffResult("bmp", IMAGE, still)  # BMP reserved fields are zero: a cheap sanity check
    return None


def _sniff_plain_audio(head: bytes) -> SniffResult | None:
    audio_only = frozenset({AUDIO})
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return SniffResult("wav", AUDIO, audio_only)
    if head[:4] == b"fLaC":
        return SniffResult("flac", AUDIO, audio_only)
    if head[:3] == b"ID3":
        return SniffResult("mp3", AUDIO, audio_only)
    if len(head) >= 2 and head[0] == 0xFF:
        # MPEG audio frame sync: 11 set bits.  ADTS (AAC) has layer bits 00; MP3 (layer III) 01.
        if head[1] & 0xF6 == 0xF0:
            return SniffResult("aac", AUDIO, audio_only)
        if head[1] & 0xE0 == 0xE0 and head[1] & 0x06 != 0:
            return SniffResult("mp3", AUDIO, audio_only)
    return None


def _probe(data: bytes, max_pixels: int) -> SniffResult:
    """Ask FFmpeg which demuxer and streams the bytes hold (containers that may be audio or video,
    and formats without a magic we check). A video stream counts when the media stages would
    decode it (``av_container.video_stream``), or when its size read 0 under ``max_pixels``
    and either its header states one over the limit or no audio stream could serve instead: the
    probe of the video then refuses it with the pixel limit's 413 (a file whose only readable
    stream is its audio stays an audio)."""
    try:
        with open_av(data, max_pixels=max_pixels) as container:
            fmt = _PROBE_FORMATS.get(container.format.name)
            audios = [s for s in container.streams.audio
                      if s.codec_context is not None and s.codec_context.sample_rate > 0]
            video = video_stream(container) is not None or (
                bool(sizeless_video(container))
                and (not audios or oversized_video(data, container, max_pixels) is not None))
            name = container.format.name
    except (av.FFmpegError, UnicodeDecodeError, ValueError) as exc:
        raise UnsupportedMediaType(f"content is not a supported image, audio or video ({exc})") from exc
    if fmt is None:
        raise UnsupportedMediaType(f"container format {name!r} is not accepted")
    if fmt == "matroska" and b"webm" in data[:64]:
        fmt = "webm"  # the EBML header's DocType says which Matroska profile this is
    kinds = ({VIDEO} if video else set()) | ({AUDIO} if audios else set())
    if not kinds:
        raise UnsupportedMediaType(f"{fmt} container holds no decodable audio or video stream")
    return SniffResult(fmt, VIDEO if video else AUDIO, frozenset(kinds), probed=True)


class SniffMemo:
    """Sniff answers by content key (blake3 of the bytes): a repeated container is not opened
    and probed again -- ingest hashes first, then asks here. Bounded LRU, thread-safe (ingest
    runs on the media workers). Bytes decide the answer alone, so an entry never goes stale.
    ``salt``: a request's cache_salt; answers are shared only within one salt (None is one too),
    so a tenant cannot time whether another's request already brought the same bytes."""

    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 0:
            raise ValueError(f"SniffMemo max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str | None, str], SniffResult] = OrderedDict()

    def get(self, content_key: str, salt: str | None = None) -> SniffResult | None:
        entry = (salt, content_key)
        with self._lock:
            found = self._entries.get(entry)
            if found is not None:
                self._entries.move_to_end(entry)
            return found

    def put(self, content_key: str, result: SniffResult, salt: str | None = None) -> None:
        entry = (salt, content_key)
        with self._lock:
            self._entries[entry] = result
            self._entries.move_to_end(entry)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
