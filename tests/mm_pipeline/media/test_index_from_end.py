"""An MP4 with its index after its samples, decoded while it arrives (media.index_from_end).

What is proven: where the index begins is read from the first bytes (and nothing is claimed for
other layouts, a truncated head or an mdat that runs to the end); a tail put into an arriving body
answers reads at and after its offset before the body gets there, and the size; ``finish`` tells a
tail that was not the body's end; through ``MediaIngestor`` and a throttled loopback host that
honours ranges, the early decoder starts before the last byte and every chunk's frames equal the
whole-bytes decode (also with kilobytes of camera metadata before the samples); a host that says
it has no ranges is not asked, one that does not say is asked once; a host without ranges, or one
whose range gives other bytes (the file changed), gets the video decoded after arrival with
nothing of the early decode used; an audio-only MP4 (a
voice memo) with its index last, and a video's sound track, once the index is in, decode to
samples bit-identical to the whole bytes'.
"""

from __future__ import annotations

import io

import pytest
import torch

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.audio import decode_audio, header_seconds
from mm_pipeline.media.decode.early import EarlyDecoders, EarlyVideoDecode
from mm_pipeline.media.decode.early_audio import EarlyAudioDecode
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import index_after_samples
from mm_pipeline.media.types import MediaItem, MediaKind
from samples.synthetic.throttled_http import remux_layout
from tests.support.arriving import early_covers_whole, feed, ingest_throttled, layout_clips
from tests.support.mp4_boxes import box_at, with_box_before_samples
from tests.support.media_samples import audio_bytes, video_bytes

SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    # samples over 64 KB: FFmpeg reads through a shorter mdat to the index instead of seeking past it
    return layout_clips((320, 240), ("index-at-end", "index", "fragments", "matroska"))


def test_where_the_index_begins(clips) -> None:
    at_end = clips["index-at-end"]
    assert index_after_samples(at_end[:64], len(at_end)) == box_at(at_end)
    for layout in ("index", "fragments", "matroska"):
        assert index_after_samples(clips[layout][:64], len(clips[layout])) is None
    assert index_after_samples(at_end[:30], len(at_end)) is None  # the mdat header not in yet
    assert index_after_samples(at_end[:64], box_at(at_end)) is None  # nothing after the samples
    runs_to_end = at_end[:36] + bytes(4) + at_end[40:64]  # an mdat of size 0 runs to the end of the file
    assert index_after_samples(runs_to_end, len(at_end)) is None


def test_a_tail_answers_before_the_body_gets_there(clips) -> None:
    data = clips["index-at-end"]
    at = box_at(data)
    body = ArrivingBytes(1 << 24, stall_s=5.0, declared_size=len(data))
    body.feed(data[:100])
    reader = body.reader()
    assert reader.seek(0, io.SEEK_END) == -1  # no tail yet: the size is not known
    with pytest.raises(ValueError, match="declared size"):
        body.put_tail(at, data[at:-1])
    body.put_tail(at, data[at:])
    assert reader.seek(0, io.SEEK_END) == len(data)
    reader.seek(at)
    assert reader.read(16) == data[at:at + 16]  # at once: the body holds 100 bytes
    body.feed(data[100:])
    whole, _ = body.finish()
    assert whole == data and not body.tail_mismatch and not body.has_tail
    reader.seek(at)
    assert reader.read(16) == data[at:at + 16]  # now from the body itself
    other = ArrivingBytes(1 << 24, stall_s=5.0, declared_size=len(data))
    other.feed(data[:100])
    other.put_tail(at, data[at:-1] + b"\0")
    other.feed(data[100:])
    other.finish()
    assert other.tail_mismatch


def _decoded_early(data: bytes) -> None:
    """Through the ingestor: the index fetched by one range request, then decoded while it arrives."""
    item, counts, host = ingest_throttled(data, SAMPLING)
    assert host.range_requests == 1 and counts["index_from_end"] == 1
    early_covers_whole(item, SAMPLING)


def test_decoded_while_it_arrives_once_the_index_is_fetched(clips) -> None:
    _decoded_early(clips["index-at-end"])


def test_metadata_before_the_samples(clips) -> None:
    """8 KiB of camera metadata between ``ftyp`` and ``mdat``: the index is still found from the first
    bytes that told the layout."""
    data = with_box_before_samples(clips["index-at-end"], b"uuid", bytes(range(16)) + bytes(8192))
    assert index_after_samples(data[:64], len(data)) is None  # the mdat header is past byte 64
    _decoded_early(data)


def test_no_ranges_or_another_file_decodes_after_arrival(clips) -> None:
    """A host that says it has no ranges is not asked; one that does not say is asked once and its
    whole-body answer dropped; one whose range gives other bytes (the file changed) has the early
    decode dropped. Each: decoded after arrival, the body's own bytes."""
    data = clips["index-at-end"]
    item, counts, host = ingest_throttled(data, SAMPLING, ranges=False)
    # "Accept-Ranges: none" on the body: no range request is even sent
    assert item.early is None and host.range_asks == 0 and "index_from_end" not in counts
    item, counts, host = ingest_throttled(data, SAMPLING, ranges=False, advertise_ranges=False)
    # a host that does not say: asked once, its whole-body answer dropped unread
    assert item.early is None and host.range_asks == 1 and host.range_requests == 0
    assert "index_from_end" not in counts and item.data == data
    at = box_at(data)
    changed = data[:at + 40] + bytes([data[at + 40] ^ 0xFF]) + data[at + 41:]
    item, counts, host = ingest_throttled(data, SAMPLING, range_files={"/v.mp4": changed})
    assert host.range_requests == 1 and counts["index_from_end"] == 1 and counts["index_from_end_mismatches"] == 1
    assert item.early is None and item.data == data  # nothing decoded from the other index is used


def _with_tail(data: bytes, kind: MediaKind | None, **decoders) -> tuple[object, ArrivingBytes]:
    """An early decode started on the first 4 KiB of ``data`` once its index is put in, then the rest fed."""
    at = index_after_samples(data[:64], len(data))
    assert at == box_at(data) and at > 1 << 16  # over 64 KB of samples: FFmpeg seeks past them
    body = ArrivingBytes(1 << 24, stall_s=5.0, declared_size=len(data))
    body.feed(data[:4096])
    body.put_tail(at, data[at:])
    early = EarlyDecoders(SAMPLING, MediaLimits(), fetch_timeout_s=10.0, audio_rate=16000, **decoders).start(
        body, "index", kind)
    feed(body, data[4096:], chunk=4096).join()
    assert not body.tail_mismatch
    return early, body


@pytest.mark.parametrize("what", ["audio", "sound"])
def test_audio_and_sound_with_the_index_last(what: str) -> None:
    """A voice memo (AAC in MP4, FFmpeg writes its moov last) as an audio item, and the sound track
    of a video with its index last: samples bit-identical to decoding the whole bytes."""
    if what == "audio":
        data = audio_bytes("mp4", "aac", 44100, 12.0)
        early, _ = _with_tail(data, MediaKind.AUDIO)
        item, sound = MediaItem(MediaKind.AUDIO, "mp4", data), early
    else:
        data = remux_layout(video_bytes("mp4", fps=10, n_frames=120, size=(320, 240), gop=10, with_audio=True),
                            "index-at-end")
        early, _ = _with_tail(data, None, video_sound=True)
        assert isinstance(early, EarlyVideoDecode)
        item, sound = MediaItem(MediaKind.VIDEO, "mp4", data), early.sound
    assert isinstance(sound, EarlyAudioDecode)
    audio = sound.result(item, header_seconds(item))
    assert audio is not None and torch.equal(audio.samples, decode_audio(item, 16000).samples)
    assert sound.received_at_first_chunk is not None and sound.received_at_first_chunk < len(data)
    early.cancel()
