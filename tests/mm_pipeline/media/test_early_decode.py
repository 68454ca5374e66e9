"""Decoding while the bytes arrive (media.decode.early, sniff.streamable_layout; the buffer itself:
test_arriving_bytes.py).

What is proven: the layout answer of each container, and the bytes it needs where the first do
not tell (an index of megabytes is read once, when whole, and decoded while the rest arrives); a
header over a limit gets nothing decoded early; an early decode starts before the last byte and its
frames -- taken by production chunk by chunk, misses decoded as before -- equal the whole-bytes
decode for fragmented MP4, moov-first MP4 and Matroska; a body that fails mid-way or stalls ends
the decoder thread; a cancelled decode drops its frames.
"""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.errors import MediaTooLarge
from mm_pipeline.media.decode.budget import DecodeBudget
from mm_pipeline.media.decode.video import decode_range, probe_video
from mm_pipeline.media.decode.early import EarlyDecoders, EarlyVideoDecode
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.sniff import (MAX_INDEX_BYTES, fragments_duration, index_after_samples, layout_and_need,
                                     streamable_layout)
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.media.decode.video_chunks import chunks_for_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from tests.support.arriving import (early_chunks_match_whole, early_covers_whole, feed, ingest_throttled,
                                    layout_clips, start_early)
from tests.support.mp4_boxes import box_at, with_bigger_index, with_box_before_samples
from samples.synthetic.hostile_media import resizing_webm, tiny_boxes_mp4
from tests.support.media_samples import image_bytes

SAMPLING = VideoSamplingParams(fps=2.0, min_frames=4, max_frames=64)


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return layout_clips((96, 64), ("fragments", "index", "matroska", "index-at-end"))


def test_streamable_layout(clips) -> None:
    for layout in ("fragments", "index", "matroska"):
        assert streamable_layout(clips[layout]) == layout
    assert streamable_layout(clips["index-at-end"]) == ""
    assert streamable_layout(clips["index"][:20]) is None  # moov not yet complete
    assert streamable_layout(image_bytes()) == ""
    assert streamable_layout(b"OggS" + bytes(20)) == "ogg"


def test_the_bytes_a_layout_needs(clips) -> None:
    """Where the first bytes do not tell, ``layout_and_need`` names the end of the box it stopped
    in: looking again with that many answers (an index of megabytes included); an index past
    ``MAX_INDEX_BYTES`` is not waited for."""
    assert layout_and_need(b"") == (None, 12)
    data = with_bigger_index(clips["index"], 3 << 20)
    moov_end = box_at(data) + int.from_bytes(data[box_at(data):box_at(data) + 4], "big")
    assert moov_end > 3 << 20
    head, steps = data[:64], 0
    while (answer := layout_and_need(head))[0] is None:
        assert answer[1] > len(head)
        head, steps = data[:answer[1]], steps + 1
    assert answer == ("index", moov_end) and steps <= 3
    huge = data[:box_at(data)] + (MAX_INDEX_BYTES + 1).to_bytes(4, "big") + b"moov"
    assert layout_and_need(huge) == ("", len(huge))


def test_a_head_of_tiny_boxes_is_not_walked_to_its_end(clips) -> None:
    """A sender's 1 MiB of 8-byte boxes after ``ftyp``: the walks stop after a bounded number of
    boxes (each look at an arriving body runs on the event loop) and answer "not early"."""
    head = tiny_boxes_mp4(clips["index"])  # ftyp, 1 MiB of 8-byte boxes, moov, mdat
    assert layout_and_need(head) == ("", len(head))  # not None: more bytes would not be looked at
    assert index_after_samples(head, len(head) + 100) is None
    assert fragments_duration(head) is None


@pytest.fixture(scope="module")
def variants(clips) -> dict[str, bytes]:
    """The clips and two reshaped MP4s: a 3 MiB index first, 9 KB of camera metadata before the samples."""
    return {**clips, "big-index": with_bigger_index(clips["index"], 3 << 20),
            "camera": with_box_before_samples(clips["index-at-end"], b"uuid", bytes(9000))}


@settings(max_examples=60, deadline=None)
@given(which=st.sampled_from(["index", "fragments", "matroska", "index-at-end", "big-index", "camera"]),
       cuts=st.lists(st.integers(1, 1 << 16), min_size=1, max_size=40))
def test_looking_again_when_the_needed_bytes_are_in(variants, which: str, cuts: list[int]) -> None:
    """However the bytes arrive, looking again only once ``need`` bytes are in (as the fetch does)
    gives the whole file's answer, and ``need`` always asks for more than it was shown."""
    data = variants[which]
    received, need, answer = 0, 0, None
    for cut in [*cuts, len(data)]:
        received = min(len(data), received + cut)
        while answer is None and received >= need:
            head = data[:min(received, max(need, 1 << 16))]
            answer, need = layout_and_need(head)
            assert answer is not None or need > len(head)
    assert answer == streamable_layout(data)


def test_an_index_of_megabytes_is_read_once_and_decoded_while_arriving(monkeypatch) -> None:
    """A moov-first MP4 whose index is 2 MiB (a long video's sample tables): decoded while it
    arrives, every sampled frame equal to the whole-bytes decode; the first bytes are copied out
    a few times, not again with each 2 KiB chunk before the index is whole (~1,000 of them)."""
    copied = []
    head = ArrivingBytes.head
    monkeypatch.setattr(ArrivingBytes, "head", lambda self, n: copied.append(got := head(self, n)) or got)
    # 110 KB of samples after the index: they arrive after the decoder started
    data = with_bigger_index(layout_clips((320, 240), ("index",))["index"], 2 << 20)
    item, counts, _ = ingest_throttled(data, SAMPLING, seconds=2.0)  # the samples: the last ~0.1 s
    assert counts["early_decodes.video"] == 1
    early_covers_whole(item, SAMPLING)
    layout_copies = [len(c) for c in copied if len(c) > 1 << 16]
    assert 1 <= len(layout_copies) <= 2 and sum(layout_copies) < 2 * len(data), layout_copies


# ---- early decode --------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [{}, {"max_pixels": 96 * 64 - 1}, {"max_frames": 119}, {"max_duration_s": 11.0}])
def test_over_a_header_limit_nothing_is_decoded(clips, limit: dict) -> None:
    """A header over ``probe_video``'s limits (pixels, frames, duration: 96x64, 120 frames, 12 s
    here) gets no frame decoded early -- the whole-bytes path refuses it after arrival."""
    body = ArrivingBytes(1 << 24, stall_s=5.0)
    body.feed(clips["index"][:4096])
    early = EarlyDecoders(SAMPLING, MediaLimits(**limit), fetch_timeout_s=10.0).start(body, "index", MediaKind.VIDEO)
    assert isinstance(early, EarlyVideoDecode)
    feed(body, clips["index"][4096:]).join()
    assert early.join(10.0)
    assert early.over_limits == bool(limit) and (early.frames_decoded == 0) == bool(limit)


@pytest.mark.parametrize("layout", ["index", "matroska", "fragments"])
def test_early_frames_equal_whole_decode(clips, layout: str) -> None:
    data = clips[layout]
    early, body, sender = start_early(data, layout, SAMPLING, pause_s=0.02)  # the decoder keeps up with the sender
    sender.join()
    item = MediaItem(MediaKind.VIDEO, "mp4", data, early=early)
    info = probe_video(item)
    sampling = sample_frames(info.total_frames, info.video_fps, SAMPLING)
    tp, size = 2, (32, 48)
    chunks = plan_chunks(list(range(sampling.num_frames // tp)), sampling.indices, info.keyframes, tp, 2)
    assert early.join(10.0)
    if layout != "fragments":  # decoding started before the last byte
        assert early.received_at_first_frame is not None and early.received_at_first_frame < len(data)
    chosen = chunks_for_early(early, info, sampling.indices, chunks, tp)
    if layout == "fragments":  # no frame count up front: it decoded nothing, production decodes all
        assert early.prediction == "" and chosen == set()
        return
    assert chosen == set(range(len(chunks)))  # ended: every chunk takes its frames
    used = early_chunks_match_whole(early, item, info, sampling.indices, chunks, tp, size)
    assert used == len(set(sampling.indices)), early.prediction  # the count was known: every target kept


def test_body_failing_mid_way_ends_the_decoder(clips) -> None:
    data = clips["index"]
    early, body, sender = start_early(data, "index", SAMPLING, stop_at=len(data) // 2)
    sender.join()
    assert early.join(5.0) and early.ended
    stalled = ArrivingBytes(1 << 24, stall_s=0.3)
    stalled.feed(data[:len(data) // 3])  # a client that sends a third and then nothing
    early = EarlyVideoDecode(stalled, "index", SAMPLING, 1 << 26, timeout_s=30.0)
    early.start()
    assert early.join(5.0)


def test_cancel_and_slots(clips) -> None:
    data = clips["matroska"]
    decoders = EarlyDecoders(SAMPLING, MediaLimits(), fetch_timeout_s=5.0, limit=1)
    body = ArrivingBytes(1 << 24, stall_s=5.0)
    body.feed(data[:4096])
    first = decoders.start(body, "matroska")
    assert first is not None
    assert decoders.start(ArrivingBytes(1 << 24, stall_s=5.0), "matroska") is None  # no free slot
    first.cancel()
    body.fail()
    assert first.join(5.0)
    # no frame count up front: no thread at all
    assert decoders.start(ArrivingBytes(1 << 24, stall_s=5.0), "fragments") is None
    assert first.frames_until([0]) == {}
    again = decoders.start(ArrivingBytes(1 << 24, stall_s=0.2), "matroska")  # the slot came back
    assert again is not None and again.join(5.0)


def _early_to_the_end(webm: bytes) -> tuple[EarlyVideoDecode, DecodeBudget]:
    """A WebM decoded early while it arrives in 4 KiB pieces, until the decoder ends."""
    budget = DecodeBudget(1 << 30)
    body = ArrivingBytes(len(webm) + 1, stall_s=5.0, declared_size=len(webm))
    early = EarlyVideoDecode(body, "matroska", SAMPLING, max_kept_bytes=1 << 28, timeout_s=30.0, budget=budget)
    early.start()
    feed(body, webm, chunk=4096).join()
    early.join(30)
    return early, budget


def test_frames_that_grow_past_their_header_are_refused() -> None:
    """A VP8 WebM declaring 64x64 whose later keyframes are 1024x1024: the pixel limit and the
    decode budget only ever saw the header. Before, the arriving-bytes decoder kept the big frames
    while counting 64x64 each (thousands of times less), and the whole-bytes decoder ran them
    through. Both now stop with a 413 naming the growth, and nothing stays counted."""
    data = resizing_webm(big=1024, n_frames=6)
    early, budget = _early_to_the_end(data)
    assert isinstance(early._error, MediaTooLarge) and "64x64" in str(early._error)
    early.cancel()
    assert budget.early_in_use == 0
    item = MediaItem(MediaKind.VIDEO, "webm", data, "test")
    info = probe_video(item)
    with pytest.raises(MediaTooLarge, match="grow mid-stream from 64x64 .* to 1024x1024"):
        decode_range(item, info, list(range(info.total_frames)), size=(32, 32))


def test_kept_frames_count_their_own_planes() -> None:
    """Kept frames are charged what they hold as decoded, not 8-bit 4:2:0 at the header's size:
    4:4:4 is twice 4:2:0."""
    early, budget = _early_to_the_end(resizing_webm(big=64, n_frames=6, pix_fmt="yuv444p", codec="libvpx-vp9"))
    kept = dict(early._frames)
    assert kept and early._error is None
    assert all(f.format.name == "yuv444p" for f in kept.values())
    assert early._kept_bytes == budget.early_in_use == sum(p.buffer_size for f in kept.values() for p in f.planes)
    assert early._kept_bytes >= len(kept) * 64 * 64 * 3
    early.cancel()
    assert budget.early_in_use == 0
