r"""Decode an audio item while its bytes still arrive (issue 16 item 4; README "Decoding while bytes arrive").

    bytes ─► ArrivingBytes ─► early audio thread: demux + decode + resample front to back
                   │          (decode_audio_from, the whole-bytes path's own loop)
                   └─► finish: content key ─► sniff ─► plan: audio_inputs takes the samples
                                                       (or decodes the whole bytes, as before)

Audio has no sampling choice -- every sample is used -- so unlike a video nothing has to be known
up front: the decoded, resampled samples equal those of ``decode_audio`` on the whole bytes when the
demuxer reads the same packets. What each container needs for that was measured (tests check
bit-identity per format): WAV, FLAC, Ogg (Opus/Vorbis), WebM/Matroska and MP4 (``moov`` first or
fragmented) are read as from a pipe -- an Ogg demuxer that can seek jumps to the last page for the
duration and waits for the last byte; MP3 needs its size (FFmpeg trims the encoder's end padding
only when it knows it), so it is read with the declared Content-Length and not decoded early
without one, and the result is used only if the body ended with exactly that many bytes.

Limits are those of the whole-bytes path: samples are counted as decoded (``max_duration_s``, the
model's context), so a header declaring hours allocates nothing up front; the header's claim is
checked by the consumer on the whole bytes, as ``decode_audio`` does. Every resampled chunk is
taken from the server's ``DecodeBudget`` (early share) before it is kept; no room, a damaged or
odd stream, a cancel (cache hit, request dropped its item), a failed body: the thread stops, frees
its samples, and the item is decoded from the whole bytes after arrival, as without this feature.
"""

from __future__ import annotations

import threading
from typing import Callable

from mm_pipeline.errors import ContextLengthError, MediaError, MediaTooLarge
from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.audio import check_header_seconds, decode_audio_from
from mm_pipeline.media.decode.budget import DecodeBudget, DecodeControl, MediaDecodeTimeout, check
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import open_av_stream, plain_audio_format
from mm_pipeline.media.types import DecodedAudio, MediaItem, MediaKind


class _NoRoom(MediaError):
    """The budget's early share is full: stop, the item is decoded after arrival."""


def audio_reading(head: bytes, layout: str, kind: MediaKind | None, declared_size: int | None,
                  tail: bool = False) -> tuple[bool, bool] | None:
    """How to read an arriving body as audio -- (seekable, known_size) for ``ArrivingBytes.reader``
    -- or None when it is not decoded early as audio: a declared video, a container that may hold
    a video and was not declared audio (decoded early as a video, ``media.decode.early``), an
    Ogg with a Theora stream, an MP3 without a declared size (module doc). ``tail``: the body's end
    is in already (an MP4 whose index follows its samples, media.index_from_end): read seekable,
    so the demuxer jumps to that index and back, as it does for a video's sound track."""
    if kind is MediaKind.VIDEO:
        return None
    ogg_audio = layout == "ogg" and b"\x80theora" not in head  # every stream's first page leads an Ogg
    if not (layout == "audio" or ogg_audio or (kind is MediaKind.AUDIO and layout in ("ogg", "matroska", "index",
                                                                                       "fragments"))):
        return None
    if plain_audio_format(head) == "mp3":
        return (True, True) if declared_size is not None else None
    return (tail and layout == "index"), False


class EarlyAudioDecode:
    """One audio item decoded and resampled on its own thread while its bytes arrive.

    Invariant (under ``_lock``): ``_held`` = the bytes this decode took from the budget and has
    not released; 0 once cancelled; ``_audio`` is set only when the decode ran to the end."""

    kind = MediaKind.AUDIO

    def __init__(self, body: ArrivingBytes, sample_rate: int, limits: MediaLimits, context_samples: int | None,
                 timeout_s: float, budget: DecodeBudget, reading: tuple[bool, bool], origin: str = "remote",
                 on_end: Callable[[], None] | None = None) -> None:
        self.body = body
        self.sample_rate = sample_rate
        self.limits = limits
        self.context_samples = context_samples
        self.budget = budget
        self.seekable, self.known_size = reading
        self.received_at_start = body.received  # bytes in when decoding started (the rest: outstanding)
        self.received_at_first_chunk: int | None = None  # bytes in when the first samples came out
        self.control = DecodeControl(timeout_s, what="an arriving audio")
        self._origin = origin
        self._on_end = on_end
        self._lock = threading.Lock()
        self._held = 0
        self._audio: DecodedAudio | None = None
        self._limit_error: MediaError | None = None  # what the whole-bytes decode would raise too
        self._failed: BaseException | None = None  # anything else: decode the whole bytes instead
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmserve-early-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop at the next packet and free the samples (safe from any thread, any number of times)."""
        self.control.cancel()
        with self._lock:
            self._audio = None
            self._give_back(self._held)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def ended(self) -> bool:
        return self._done.is_set()

    @property
    def held(self) -> int:
        """Budget bytes held for the decoded samples (the consumer's reservation counts them)."""
        with self._lock:
            return self._held

    def result(self, item: MediaItem, header_s: float | None,
               control: DecodeControl | None = None) -> DecodedAudio | None:
        """Wait for the decoder to end: the audio of ``item`` (the whole body, sniffed), or None
        (decode the whole bytes instead). ``header_s``: the duration the whole bytes' header
        claims, checked first as ``decode_audio`` does; then the limit errors the decode met (the
        same the whole bytes would meet)."""
        check_header_seconds(header_s, self.limits)
        while not self._done.wait(0.05):
            check(control)
        if self._limit_error is not None:
            raise self._limit_error
        with self._lock:
            if self._audio is None or (self.known_size and not self.body.size_as_declared):
                return None
            return DecodedAudio(self._audio.samples, self._audio.sample_rate, item.format)

    # ---- the decoder thread -----------------------------------------------------------------
    def _run(self) -> None:
        # origin in messages as the whole-bytes path words them; format: not sniffed yet
        item = MediaItem(MediaKind.AUDIO, "audio", b"", origin=self._origin)
        chunk_bytes = 0

        def grow(nbytes: int) -> None:
            nonlocal chunk_bytes
            if self.received_at_first_chunk is None:
                self.received_at_first_chunk = self.body.received
            # a chunk now and its copy in the concatenation at the end
            if not self.budget.take_early(2 * nbytes):
                raise _NoRoom("the decode budget's early share is full")
            with self._lock:
                self._held += 2 * nbytes
            chunk_bytes += nbytes

        try:
            reader = self.body.reader(seekable=self.seekable, known_size=self.known_size)
            with open_av_stream(reader) as container:
                audio = decode_audio_from(container, item, self.sample_rate, self.limits, self.control,
                                          self.context_samples, check_header=False, grow=grow)
            with self._lock:
                self._give_back(chunk_bytes)  # the chunks are gone, their concatenation stays
                if not self.control.cancelled:
                    self._audio = audio
        except (ContextLengthError, MediaTooLarge) as exc:
            if isinstance(exc, MediaDecodeTimeout):
                self._failed = exc
            else:
                self._limit_error = exc  # counted from decoded samples: the whole bytes meet it too
        except BaseException as exc:  # a body that failed, an odd stream, no room, cancel, deadline
            self._failed = exc
        finally:
            if self._audio is None:
                self.cancel()
            self._done.set()
            if self._on_end is not None:
                self._on_end()

    def _give_back(self, nbytes: int) -> None:
        """Release ``nbytes`` of what is held (caller holds ``_lock``)."""
        nbytes = min(nbytes, self._held)
        self._held -= nbytes
        self.budget.release_early(nbytes)


def early_audio_of(item: MediaItem) -> EarlyAudioDecode | None:
    """The early decode holding ``item``'s samples: an audio item's own, a video's sound track's
    (its early video decode's ``sound``), or None (decode the whole bytes)."""
    if isinstance(item.early, EarlyAudioDecode):
        return item.early
    return getattr(item.early, "sound", None)
