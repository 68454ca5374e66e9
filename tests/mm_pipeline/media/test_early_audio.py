"""Decoding audio while its bytes arrive (media.decode.early_audio, issue 16 item 4).

What is proven: for WAV, MP3 (with its declared size), Ogg/Opus, FLAC, ADTS, audio-only WebM and
MP4 (moov first, fragmented) the early decode's samples are bit-identical to ``decode_audio`` on
the whole bytes, and it started before the last byte; an MP3 without a declared size, a declared
video, an Ogg with Theora are not decoded early as audio; the limits are the whole path's (a header
claiming an hour allocates nothing and is refused like the whole bytes; the context limit stops the
decode with the same error); cancel and a full budget free every byte and fall back to the
whole-bytes decode.
"""

from __future__ import annotations

import struct
import time

import pytest
import torch

from mm_pipeline.errors import ContextLengthError, MediaTooLarge
from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.audio import decode_audio, header_seconds
from mm_pipeline.media.decode.budget import DecodeBudget
from mm_pipeline.media.decode.early import EarlyDecoders
from mm_pipeline.media.decode.early_audio import EarlyAudioDecode, audio_reading
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import sniff, streamable_layout
from mm_pipeline.media.types import MediaItem, MediaKind
from tests.support.arriving import feed, remux
from tests.support.media_samples import audio_bytes

RATE = 16000


@pytest.fixture(scope="module")
def clips() -> dict[str, tuple[bytes, MediaKind | None]]:
    """name -> (bytes, the kind the request declares)."""
    aac = audio_bytes("mp4", "aac", 44100, 3.0)
    return {
        "wav": (audio_bytes("wav", "pcm_s16le", 16000, 8.0, channels=1), None),
        "mp3": (audio_bytes("mp3", "libmp3lame", 44100, 3.0), None),
        "ogg_opus": (audio_bytes("ogg", "libopus", 48000, 3.0), None),
        "flac": (audio_bytes("flac", "flac", 44100, 3.0), None),
        "adts": (audio_bytes("adts", "aac", 44100, 3.0), None),
        "webm_opus": (audio_bytes("webm", "libopus", 48000, 3.0), MediaKind.AUDIO),
        "mp4_faststart": (remux(aac, "mp4", "faststart", kind="audio"), MediaKind.AUDIO),
        "mp4_fragments": (remux(aac, "mp4", "frag_keyframe+empty_moov+default_base_moof", kind="audio"), MediaKind.AUDIO),
    }


def _start(data: bytes, kind: MediaKind | None, declared: bool = True, budget: DecodeBudget | None = None,
           limits: MediaLimits = MediaLimits(), context: int | None = None, origin: str = "remote"
           ) -> tuple[EarlyAudioDecode | None, ArrivingBytes]:
    """An arriving body whose first bytes are in, and the early decode EarlyDecoders starts on it."""
    body = ArrivingBytes(1 << 26, stall_s=5.0, declared_size=len(data) if declared else None)
    body.feed(data[:4096])
    layout = streamable_layout(body.head(1 << 20))
    decoders = EarlyDecoders(VideoSamplingParams(), limits, fetch_timeout_s=10.0, budget=budget, audio_rate=RATE,
                             context_samples=context)
    return decoders.start(body, layout, kind, origin), body  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["wav", "mp3", "ogg_opus", "flac", "adts", "webm_opus", "mp4_faststart",
                                  "mp4_fragments"])
def test_early_audio_is_bit_identical(clips, name: str) -> None:
    data, kind = clips[name]
    budget = DecodeBudget(1 << 30)
    early, body = _start(data, kind, budget=budget)
    assert isinstance(early, EarlyAudioDecode), streamable_layout(data)
    feed(body, data[4096:], chunk=4096).join()
    item = MediaItem(MediaKind.AUDIO, sniff(data).format, data)
    audio = early.result(item, header_seconds(item))
    whole = decode_audio(item, RATE)
    assert audio is not None and torch.equal(audio.samples, whole.samples)
    assert audio.source_format == whole.source_format
    assert early.received_at_first_chunk is not None and early.received_at_first_chunk < len(data)
    assert budget.early_in_use == early.held == audio.samples.numel() * 4  # the samples, held until used
    early.cancel()
    assert budget.in_use == 0
    budget.check_integrity()


def test_what_is_not_decoded_early_as_audio(clips) -> None:
    mp3, _ = clips["mp3"]
    early, body = _start(mp3, None, declared=False)
    assert early is None  # its end padding needs the size: decoded after arrival
    assert audio_reading(mp3[:4096], "audio", MediaKind.VIDEO, len(mp3)) is None  # declared a video
    assert audio_reading(b"OggS" + bytes(24) + b"\x80theora", "ogg", None, None) is None
    webm, _ = clips["webm_opus"]
    assert audio_reading(webm[:4096], "matroska", None, len(webm)) is None  # may be a video: not declared audio
    assert audio_reading(webm[:4096], "matroska", MediaKind.AUDIO, len(webm)) == (False, False)


def _wav_claiming(seconds_claimed: float, data: bytes) -> bytes:
    """``data`` (a 16-bit mono WAV) with its RIFF and data sizes claiming ``seconds_claimed``."""
    pos = data.index(b"data")
    claimed = int(seconds_claimed * RATE * 2)
    return data[:4] + struct.pack("<I", claimed + pos) + data[8:pos + 4] + struct.pack("<I", claimed) + data[pos + 8:]


def test_limits_are_those_of_the_whole_bytes(clips) -> None:
    wav, _ = clips["wav"]  # 8 s
    liar = _wav_claiming(3600.0, wav)  # an hour claimed, 8 s sent: nothing sized by the claim
    budget = DecodeBudget(1 << 30)
    early, body = _start(liar, None, budget=budget, limits=MediaLimits(max_duration_s=60.0))
    assert early is not None
    feed(body, liar[4096:], chunk=4096).join()
    item = MediaItem(MediaKind.AUDIO, "wav", liar)
    audio = early.result(item, header_seconds(item))
    assert audio is not None and torch.equal(audio.samples, decode_audio(item, RATE).samples)
    assert budget.early_in_use == 8 * RATE * 4  # what was decoded
    early.cancel()
    limits = MediaLimits(max_duration_s=5.0)  # over the limit: refused with the whole bytes' words
    early, body = _start(wav, None, budget=budget, limits=limits)
    feed(body, wav[4096:], chunk=4096).join()
    item = MediaItem(MediaKind.AUDIO, "wav", wav)
    with pytest.raises(MediaTooLarge) as whole:
        decode_audio(item, RATE, limits)
    with pytest.raises(MediaTooLarge) as streamed:
        early.result(item, header_seconds(item))
    assert str(streamed.value) == str(whole.value)
    assert early.join(5.0) and budget.in_use == 0  # stopped just past 5 s of samples, freed them
    # the context limit: counted as decoded, the same error as the whole bytes
    early, body = _start(wav, None, budget=budget, context=RATE, origin="http://host/a.wav")
    feed(body, wav[4096:], chunk=4096).join()
    item = MediaItem(MediaKind.AUDIO, "wav", wav, origin="http://host/a.wav")
    with pytest.raises(ContextLengthError) as whole_ctx:
        decode_audio(item, RATE, context_samples=RATE)
    with pytest.raises(ContextLengthError) as streamed_ctx:
        early.result(item, header_seconds(item))
    assert str(streamed_ctx.value) == str(whole_ctx.value)
    early.cancel()
    assert budget.in_use == 0


def test_cancel_and_a_full_budget_fall_back(clips) -> None:
    data, _ = clips["ogg_opus"]
    budget = DecodeBudget(1 << 30)
    early, body = _start(data, None, budget=budget)
    assert early is not None
    sender = feed(body, data[4096:], chunk=1024, pause_s=0.01)
    time.sleep(0.1)
    early.cancel()  # a cache hit, or the request dropped its item
    assert early.join(5.0)
    sender.join()
    item = MediaItem(MediaKind.AUDIO, "ogg", data)
    assert early.result(item, None) is None and budget.in_use == 0
    tight = DecodeBudget(4096)  # early share 2 KiB: the first chunk does not fit
    early, body = _start(data, None, budget=tight)
    feed(body, data[4096:], chunk=4096).join()
    assert early.join(5.0)
    assert early.result(item, None) is None and tight.in_use == 0  # decoded after arrival instead
    tight.check_integrity()
