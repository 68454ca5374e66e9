"""A video's sound track decoded while the video arrives (media.decode.early, ``EarlyVideoDecode.sound``).

What is proven: for moov-first MP4, Matroska and fragmented MP4 stating its duration, the sound
decoded on its own reader is bit-identical to ``decode_audio`` on the whole bytes, starts before the
last byte, and the frames of the same early decode still equal the whole-bytes decode; its samples
are held in the server's DecodeBudget until used; no sound thread when the model does not hear
videos or no thread is free, and a silent video's ends at the header; the limits are the whole
path's (samples counted as decoded, the same errors); a cancel (cache hit, dropped request) stops
frames and sound and frees every byte, while dropping the frames alone lets the sound finish.
"""

from __future__ import annotations

import time

import pytest
import torch

from mm_pipeline.errors import ContextLengthError, MediaTooLarge
from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.audio import decode_audio, header_seconds
from mm_pipeline.media.decode.budget import DecodeBudget
from mm_pipeline.media.decode.early import EarlyDecoders, EarlyVideoDecode
from mm_pipeline.media.decode.early_audio import early_audio_of
from mm_pipeline.media.decode.early_audio import EarlyAudioDecode
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.decode.video_chunks import chunks_for_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import sniff, streamable_layout
from mm_pipeline.media.types import MediaItem, MediaKind
from samples.synthetic.throttled_http import remux_layout
from tests.support.arriving import early_chunks_match_whole, feed
from tests.support.media_samples import video_bytes

RATE = 16000
SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)
LAYOUTS = ("index", "matroska", "fragments-sidx")
HEAD = 16384  # the first bytes in when the layout is known (a moov-first header is ~4.5 KB)


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    """10 s, 10 fps, with a 16 kHz AAC sound track, in each layout (packets interleaved by time)."""
    base = video_bytes("mp4", fps=10, n_frames=100, size=(64, 48), gop=10, with_audio=True)
    silent = video_bytes("mp4", fps=10, n_frames=100, size=(64, 48), gop=10)
    return {**{layout: remux_layout(base, layout) for layout in LAYOUTS}, "silent": remux_layout(silent, "index")}


def _start(data: bytes, budget: DecodeBudget, limits: MediaLimits = MediaLimits(), context: int | None = None,
           video_sound: bool = True, limit: int = 4) -> tuple[EarlyVideoDecode, ArrivingBytes]:
    body = ArrivingBytes(1 << 26, stall_s=5.0, declared_size=len(data))
    body.feed(data[:HEAD])
    decoders = EarlyDecoders(SAMPLING, limits, fetch_timeout_s=10.0, limit=limit, budget=budget, audio_rate=RATE,
                             context_samples=context, video_sound=video_sound)
    early = decoders.start(body, streamable_layout(body.head(1 << 20)), None, "http://host/v.mp4")
    assert isinstance(early, EarlyVideoDecode)
    return early, body


def _item(data: bytes) -> MediaItem:
    return MediaItem(MediaKind.VIDEO, sniff(data).format, data, origin="http://host/v.mp4")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sound_is_decoded_while_the_video_arrives_bit_identical(clips, layout: str) -> None:
    data = clips[layout]
    budget = DecodeBudget(1 << 30)
    early, body = _start(data, budget)
    assert isinstance(early.sound, EarlyAudioDecode)
    feed(body, data[HEAD:], chunk=4096).join()
    item = _item(data)
    item = MediaItem(item.kind, item.format, item.data, item.origin, early=early)
    assert early_audio_of(item) is early.sound
    audio = early.sound.result(item, header_seconds(item))
    whole = decode_audio(item, RATE)
    assert audio is not None and torch.equal(audio.samples, whole.samples)
    assert audio.source_format == whole.source_format
    assert early.sound.received_at_first_chunk is not None and early.sound.received_at_first_chunk < len(data)
    assert early.sound.held == audio.samples.numel() * 4 and budget.early_in_use >= early.sound.held
    # the frames of the same early decode: unchanged by the sound beside them, and every sampled
    # frame predicted and kept (a fragmented MP4 with sound has an average rate FFmpeg gets wrong:
    # 9.4 for this 10 fps clip; the guessed rate's count is kept too)
    assert early.join(5.0)
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, SAMPLING)
    chunks = plan_chunks(list(range(sampling.num_frames // 2)), sampling.indices, info.keyframes, 2, 2)
    chunks_for_early(early, info, sampling.indices, chunks, 2)
    targets = sum(len({sampling.indices[g * 2 + j] for g in groups for j in range(2)}) for groups in chunks)
    assert early_chunks_match_whole(early, item, info, sampling.indices, chunks, 2, (48, 64)) == targets
    early.cancel()
    assert early.join(5.0) and early.sound.join(5.0)
    assert budget.in_use == 0
    budget.check_integrity()


def test_when_no_sound_is_decoded_early(clips) -> None:
    budget = DecodeBudget(1 << 30)
    early, body = _start(clips["index"], budget, video_sound=False)  # the model does not hear videos
    assert early.sound is None
    early.cancel()
    early, body = _start(clips["index"], budget, limit=1)  # one thread free: the frames take it
    assert early.sound is None
    early.cancel()
    silent = clips["silent"]
    early, body = _start(silent, budget)
    assert early.sound is not None
    assert early.sound.join(5.0)  # no audio stream: its thread ends at the header, holding nothing
    assert early.sound.result(_item(silent), None) is None and early.sound.held == 0
    feed(body, silent[4096:], chunk=4096).join()
    assert early.join(5.0) and early.last_pts is not None  # the frames decoded on
    early.cancel()
    assert budget.in_use == 0


def test_sound_limits_are_those_of_the_whole_bytes(clips) -> None:
    data = clips["index"]  # 10 s of sound
    item = _item(data)
    budget = DecodeBudget(1 << 30)
    limits = MediaLimits(max_duration_s=5.0)  # counted as decoded: stops just past 5 s, same words
    early, body = _start(data, budget, limits=limits)
    feed(body, data[HEAD:], chunk=4096).join()
    with pytest.raises(MediaTooLarge) as whole:
        decode_audio(item, RATE, MediaLimits(max_duration_s=5.0))
    with pytest.raises(MediaTooLarge) as streamed:
        early.sound.result(item, header_seconds(item))  # the header's claim first, as the whole path
    assert str(streamed.value) == str(whole.value)
    with pytest.raises(MediaTooLarge, match=r"over 5\.0 s \(decoded\)"):
        early.sound.result(item, None)  # and the decode itself stopped on counted samples
    assert early.sound.join(5.0) and early.sound.held == 0
    early.cancel()
    early, body = _start(data, budget, context=2 * RATE)  # the model's context: 2 s of sound
    feed(body, data[HEAD:], chunk=4096).join()
    with pytest.raises(ContextLengthError) as whole_ctx:
        decode_audio(item, RATE, context_samples=2 * RATE)
    with pytest.raises(ContextLengthError) as streamed_ctx:
        early.sound.result(item, header_seconds(item))
    assert str(streamed_ctx.value) == str(whole_ctx.value)
    early.cancel()
    assert budget.in_use == 0
    budget.check_integrity()


def test_cancel_stops_frames_and_sound_while_dropping_frames_keeps_the_sound(clips) -> None:
    data = clips["matroska"]
    budget = DecodeBudget(1 << 30)
    early, body = _start(data, budget)
    sender = feed(body, data[HEAD:], chunk=1024, pause_s=0.005)
    time.sleep(0.1)
    early.cancel()  # a cache hit, or the request dropped its item
    assert early.join(5.0) and early.sound.join(5.0)
    sender.join()
    assert early.sound.result(_item(data), None) is None and budget.in_use == 0
    early, body = _start(data, budget)
    sender = feed(body, data[HEAD:], chunk=1024, pause_s=0.002)
    early.cancel_frames()  # production wants no early frame: the sound decodes on
    sender.join()
    assert early.join(5.0)
    audio = early.sound.result(_item(data), None)
    assert audio is not None and torch.equal(audio.samples, decode_audio(_item(data), RATE).samples)
    early.cancel()
    assert budget.in_use == 0
    budget.check_integrity()
